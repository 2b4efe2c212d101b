//! Mounting and unmounting.
//!
//! `fuser` without libfuse mounts with mount(2) directly when it may (as root), else through the
//! setuid `fusermount3` helper. The session loop runs on threads of its own; [`Mounted`] ends it.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fuser::{Config, MountOption, Session, SessionACL, SessionUnmounter};
use nacre_client::FileSystem;
use tokio::runtime::Handle;
use tokio::sync::watch;

use crate::{FuseConfig, FuseFs};

/// How a volume is mounted.
#[derive(Clone, Debug)]
pub struct MountOptions {
    /// The volume's name: the mount shows as `nacre:VOLUME` (type `fuse.nacre`).
    pub volume: String,
    /// How long the kernel may cache a name → inode mapping.
    pub entry_ttl: Duration,
    /// How long the kernel may cache attributes.
    pub attr_ttl: Duration,
    /// Kernel write-back caching (see [`FuseConfig::writeback`]). Off by default: with it, data
    /// written is not visible to other clients until the kernel decides to send it.
    pub writeback: bool,
    /// Largest write request from the kernel (it caps this at its own page limit, 1 MiB by
    /// default).
    pub max_write: u32,
    /// Threads reading requests from the kernel (each with its own clone of the device).
    pub threads: usize,
    /// Let other users in (`allow_other`). `None`: only when running as root.
    pub allow_other: Option<bool>,
}

impl Default for MountOptions {
    fn default() -> Self {
        let f = FuseConfig::default();
        Self {
            volume: "default".into(),
            entry_ttl: f.entry_ttl,
            attr_ttl: f.attr_ttl,
            writeback: f.writeback,
            max_write: f.max_write,
            threads: 2,
            allow_other: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("cannot mount on {}: {source}", dir.display())]
    Mount { dir: PathBuf, source: io::Error },
    #[error("cannot unmount {}: {source}", dir.display())]
    Unmount { dir: PathBuf, source: io::Error },
}

/// A mounted file system. Dropping it unmounts (errors are logged).
#[derive(Debug)]
pub struct Mounted {
    dir: PathBuf,
    unmounter: Option<SessionUnmounter>,
    thread: Option<std::thread::JoinHandle<io::Result<()>>>,
    ended: watch::Receiver<bool>,
    /// Disconnected when the session thread ends.
    done: std::sync::mpsc::Receiver<()>,
}

/// Mounts `fs` on `dir`; calls into `fs` run as tasks on `rt`. Blocks until the kernel has
/// finished the FUSE handshake (call it from a blocking context, not from a runtime worker).
///
/// A stale mount on `dir` (its process died: "transport endpoint is not connected") is detached
/// first.
pub fn mount<F: FileSystem>(
    fs: Arc<F>,
    rt: Handle,
    dir: &Path,
    opts: &MountOptions,
) -> Result<Mounted, MountError> {
    let fail = |source| MountError::Mount {
        dir: dir.to_path_buf(),
        source,
    };
    if let Err(e) = std::fs::metadata(dir)
        && e.raw_os_error() == Some(libc::ENOTCONN)
    {
        tracing::warn!(dir = %dir.display(), "detaching a stale FUSE mount");
        rustix::mount::unmount(dir, rustix::mount::UnmountFlags::DETACH)
            .map_err(|e| fail(e.into()))?;
    }
    let dir = dir.canonicalize().map_err(fail)?;
    let root = rustix::process::geteuid().is_root();

    let mut cfg = Config::default();
    cfg.mount_options = vec![
        MountOption::FSName(format!("nacre:{}", opts.volume)),
        MountOption::DefaultPermissions,
        MountOption::NoAtime,
    ];
    // fuser passes `subtype` only to fusermount; mount(2) (as root) takes it as a plain option.
    cfg.mount_options.push(if root {
        MountOption::CUSTOM("subtype=nacre".into())
    } else {
        MountOption::Subtype("nacre".into())
    });
    cfg.acl = if opts.allow_other.unwrap_or(root) {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    cfg.n_threads = Some(opts.threads.max(1));
    cfg.clone_fd = opts.threads > 1;

    let fuse = FuseFs::new(
        fs,
        rt,
        FuseConfig {
            entry_ttl: opts.entry_ttl,
            attr_ttl: opts.attr_ttl,
            writeback: opts.writeback,
            max_write: opts.max_write,
        },
    );
    let mut session = Session::new(fuse, &dir, &cfg).map_err(fail)?;
    let unmounter = session.unmount_callable();
    let (tx, ended) = watch::channel(false);
    let (done_tx, done) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("nacre-fuse".into())
        .spawn(move || {
            let r = session.run();
            let _ = tx.send(true);
            drop(done_tx);
            r
        })
        .map_err(fail)?;
    tracing::info!(dir = %dir.display(), volume = %opts.volume, "mounted");
    Ok(Mounted {
        dir,
        unmounter: Some(unmounter),
        thread: Some(thread),
        ended,
        done,
    })
}

impl Mounted {
    /// The mount point (canonical).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Resolves when the session ends: unmounted by [`Mounted::unmount`] or from outside
    /// (`umount DIR`, `fusermount3 -u DIR`).
    pub fn ended(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.ended.clone();
        async move {
            let _ = rx.wait_for(|e| *e).await;
        }
    }

    /// Whether the session has ended.
    pub fn is_ended(&self) -> bool {
        *self.ended.borrow()
    }

    /// Unmounts and waits (briefly) for the session to end. When files are still open, the
    /// mount is detached lazily instead (`umount -l`): it disappears from the namespace at once
    /// and the open files keep working until they are closed or this process exits.
    pub fn unmount(mut self) -> Result<(), MountError> {
        self.unmount_inner()
    }

    fn unmount_inner(&mut self) -> Result<(), MountError> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        let fail = |source| MountError::Unmount {
            dir: self.dir.clone(),
            source,
        };
        if !self.is_ended() {
            // A plain umount first; it fails with EBUSY while files are open.
            let plain = match self.unmounter.take() {
                Some(mut u) => u.unmount(),
                None => Ok(()),
            };
            if let Err(e) = plain {
                tracing::info!(dir = %self.dir.display(), error = %e, "busy: detaching lazily");
                match rustix::mount::unmount(&self.dir, rustix::mount::UnmountFlags::DETACH) {
                    // EINVAL: not a mount point any more (unmounted meanwhile).
                    Ok(()) | Err(rustix::io::Errno::INVAL) => {}
                    Err(e) => return Err(fail(e.into())),
                }
                // The session goes on serving the open files; it is not waited for.
                return Ok(());
            }
        }
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
            self.done.recv_timeout(Duration::from_secs(10))
        {
            tracing::warn!(dir = %self.dir.display(), "FUSE session did not end in 10 s");
            return Ok(());
        }
        match thread.join() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "FUSE session ended with an error");
                Ok(())
            }
            Err(_) => Err(fail(io::Error::other("the FUSE session thread panicked"))),
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Err(e) = self.unmount_inner() {
            tracing::warn!(error = %e, "unmount on drop failed");
        }
    }
}
