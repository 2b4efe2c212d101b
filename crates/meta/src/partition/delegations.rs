//! Directory delegations and client sessions (see the module documentation of `partition`):
//! what a delegation and a session are, when they hold (always decided by comparing with the
//! command's `now`, never by whether they are still stored), and the time indexes that forget
//! the ended ones. Invariant: `delegation_ends` and `session_times` list exactly the delegations'
//! ends and the sessions' last batch times.

use nacre_types::Ino;
use serde::{Deserialize, Serialize};

use nacre_api::meta::{Command, DELEGATION_NS, FileType, MetaError, SESSION_NS};

use super::MetaPartition;
use super::keys::{DentryVal, Key};

impl MetaPartition {
    /// `dir`'s delegation if it is `client`'s, has not ended and was not recalled: one the
    /// client may rely on, and that its changes renew.
    pub(super) fn held(&self, now: u64, client: u64, dir: Ino) -> Option<Delegation> {
        self.delegations
            .get(&dir.0)
            .filter(|d| d.live(now) && d.holder == client && !d.recalled)
            .copied()
    }

    /// `Delegated(dir)` if `cmd` would change the entries of `dir`, remove it or set its
    /// attributes, while it is delegated to another client than `client`.
    pub(super) fn check_delegations(
        &self,
        now: u64,
        client: u64,
        cmd: &Command,
    ) -> Result<(), MetaError> {
        if self.delegations.is_empty() {
            // The common case costs no lookups.
            return Ok(());
        }
        for dir in cmd
            .entry_dirs()
            .chain(self.removed_dir(cmd))
            .chain(cmd.attr_target())
        {
            if self
                .delegations
                .get(&dir.0)
                .is_some_and(|d| d.live(now) && d.holder != client)
            {
                return Err(MetaError::Delegated(dir));
            }
        }
        Ok(())
    }

    /// The local directory `cmd` would remove (or replace) if it succeeded, which its holder
    /// alone may do: the directory of a `Remove` with `dir`, the destination directory a
    /// `Rename` would replace, the inode of an `UnlinkInode` (only directories are delegated).
    fn removed_dir(&self, cmd: &Command) -> Option<Ino> {
        let dentry = |parent: Ino, name: &[u8]| {
            let key = Key::dentry(self.owned(parent).ok()?, name).ok()?;
            self.dentries.get(key.as_slice()).copied()
        };
        let dir = |d: DentryVal| (d.kind() == FileType::Dir).then_some(d.ino());
        match cmd {
            Command::Remove {
                parent,
                name,
                dir: true,
            } => dentry(*parent, name).and_then(dir),
            Command::Rename {
                src_parent,
                src_name,
                dst_parent,
                dst_name,
            } => {
                let moved = dentry(*src_parent, src_name)?;
                // Onto another name of the same inode (or itself), a rename changes nothing.
                dentry(*dst_parent, dst_name)
                    .filter(|r| r.ino() != moved.ino())
                    .and_then(dir)
            }
            Command::UnlinkInode { ino } => Some(*ino),
            _ => None,
        }
    }

    /// Records `d` as `dir`'s delegation, replacing any other.
    pub(super) fn set_delegation(&mut self, dir: u64, d: Delegation) {
        if let Some(old) = self.delegations.insert(dir, d) {
            self.delegation_ends.remove(&(old.until, dir));
        }
        self.delegation_ends.insert((d.until, dir));
    }

    pub(super) fn drop_delegation(&mut self, dir: u64) {
        if let Some(old) = self.delegations.remove(&dir) {
            self.delegation_ends.remove(&(old.until, dir));
        }
    }

    /// Forgets the delegations and sessions that ended by `now`, from the front of their time
    /// indexes: each is forgotten once, so this costs O(log n) per command, amortized.
    pub(super) fn expire(&mut self, now: u64) {
        while let Some(&(until, dir)) = self.delegation_ends.first()
            && until <= now
        {
            self.delegation_ends.pop_first();
            self.delegations.remove(&dir);
        }
        while let Some(&(at, client)) = self.session_times.first()
            && !session_live(at, now)
        {
            self.session_times.pop_first();
            self.sessions.remove(&client);
        }
    }
}

/// A directory delegated to a client (see `Command::As`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Delegation {
    /// The client (never 0).
    pub(super) holder: u64,
    /// When it ends (leader time, ns): it holds while `now < until`.
    pub(super) until: u64,
    /// Another client asked for the directory (`Recall`): no longer renewed.
    pub(super) recalled: bool,
}

impl Delegation {
    pub(super) fn granted(holder: u64, now: u64) -> Self {
        Self {
            holder,
            until: now.saturating_add(DELEGATION_NS),
            recalled: false,
        }
    }

    /// Renewed at `now`. Never shortened, though after a leader change `now` may be behind the
    /// time that set `until`: a later end costs nothing (only the holder may change the
    /// directory meanwhile), and it leaves more room to leaders' clocks that disagree by more
    /// than the margin.
    pub(super) fn renewed(self, now: u64) -> Self {
        Self {
            until: self.until.max(now.saturating_add(DELEGATION_NS)),
            ..self
        }
    }

    pub(super) fn live(&self, now: u64) -> bool {
        now < self.until
    }
}

/// A client's last applied batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Session {
    pub(super) seq: u64,
    /// When it was applied (leader time, ns).
    pub(super) at: u64,
}

impl Session {
    pub(super) fn live(&self, now: u64) -> bool {
        session_live(self.at, now)
    }
}

/// Whether a session whose last batch was applied `at` is remembered at `now`.
pub(super) fn session_live(at: u64, now: u64) -> bool {
    now < at.saturating_add(SESSION_NS)
}
