//! The one place where typed file system errors become POSIX errno values (docs/design.md §2).

use nacre_api::meta::MetaError;
use nacre_client::{DataCallError, FsError};

/// The errno the kernel hands to the application for `e`.
///
/// Every variant is matched, so a new error kind does not compile until it is mapped here.
///
/// Metadata or data being unreachable (`Unavailable`, `DataCallError::Call`) is `EIO`, not
/// `EAGAIN` or `ETIMEDOUT`: the client has already retried across replicas, elections and view
/// refreshes for its whole retry budget, so the application should see a hard error. `EAGAIN`
/// would make some programs spin on a blocking descriptor, and `ETIMEDOUT` is not an error file
/// system calls are documented to return, so most programs print it confusingly or not at all.
pub fn errno(e: &FsError) -> i32 {
    match e {
        FsError::Meta(m) => match m {
            MetaError::Exists => libc::EEXIST,
            MetaError::NotFound => libc::ENOENT,
            MetaError::NotDir => libc::ENOTDIR,
            MetaError::IsDir => libc::EISDIR,
            MetaError::NotEmpty => libc::ENOTEMPTY,
            MetaError::NameTooLong => libc::ENAMETOOLONG,
            MetaError::InvalidName => libc::EINVAL,
            // The client routes by inode ranges; a partition refusing an inode is a stale view
            // the client could not repair, not something the application did.
            MetaError::WrongPartition(_) => libc::EIO,
            MetaError::NoInodes => libc::ENOSPC,
            MetaError::NoXattr => libc::ENODATA,
            MetaError::TooManyLinks => libc::EMLINK,
            MetaError::Invalid(_) => libc::EINVAL,
            // Still delegated to another client after the wait: try again later.
            MetaError::Delegated(_) => libc::EAGAIN,
        },
        FsError::Unavailable(_) => libc::EIO,
        FsError::Data(d) => match d {
            DataCallError::NoWritablePartition => libc::ENOSPC,
            DataCallError::Data(_)
            | DataCallError::Call(_)
            | DataCallError::ShortRead { .. }
            | DataCallError::BrokenStream
            | DataCallError::BadFrame { .. } => libc::EIO,
        },
        FsError::BadHandle(_) | FsError::NotOpenFor(_) => libc::EBADF,
        FsError::WriteFailed(_) | FsError::Func(_) => libc::EIO,
        FsError::Unsupported(_) => libc::EOPNOTSUPP,
        FsError::NoSpace { .. } => libc::ENOSPC,
    }
}

#[cfg(test)]
mod tests {
    use nacre_api::data::DataError;
    use nacre_client::CallError;
    use nacre_types::{ExtentId, Ino};

    use super::*;

    #[test]
    fn every_variant_maps_to_its_errno() {
        let cases: Vec<(FsError, i32)> = vec![
            (MetaError::Exists.into(), libc::EEXIST),
            (MetaError::NotFound.into(), libc::ENOENT),
            (MetaError::NotDir.into(), libc::ENOTDIR),
            (MetaError::IsDir.into(), libc::EISDIR),
            (MetaError::NotEmpty.into(), libc::ENOTEMPTY),
            (MetaError::NameTooLong.into(), libc::ENAMETOOLONG),
            (MetaError::InvalidName.into(), libc::EINVAL),
            (MetaError::WrongPartition(Ino(7)).into(), libc::EIO),
            (MetaError::NoInodes.into(), libc::ENOSPC),
            (MetaError::NoXattr.into(), libc::ENODATA),
            (MetaError::TooManyLinks.into(), libc::EMLINK),
            (MetaError::Invalid("x".into()).into(), libc::EINVAL),
            (CallError::NotApplied("down".into()).into(), libc::EIO),
            (CallError::Unknown("timeout".into()).into(), libc::EIO),
            (
                FsError::Data(DataCallError::NoWritablePartition),
                libc::ENOSPC,
            ),
            (
                FsError::Data(DataCallError::Data(DataError::ReadOnly("full".into()))),
                libc::EIO,
            ),
            (
                FsError::Data(DataCallError::Data(DataError::NotFound(ExtentId(3)))),
                libc::EIO,
            ),
            (
                FsError::Data(DataCallError::Data(DataError::Corrupt {
                    extent: ExtentId(3),
                    block: 0,
                })),
                libc::EIO,
            ),
            (
                FsError::Data(DataCallError::Call(CallError::Unknown("reset".into()))),
                libc::EIO,
            ),
            (
                FsError::Data(DataCallError::ShortRead { want: 10, got: 3 }),
                libc::EIO,
            ),
            (FsError::BadHandle(9), libc::EBADF),
            (FsError::NotOpenFor("writing"), libc::EBADF),
            (FsError::WriteFailed("lost".into()), libc::EIO),
            (FsError::Unsupported("fallocate"), libc::EOPNOTSUPP),
            (FsError::NoSpace { wanted: 2, free: 1 }, libc::ENOSPC),
        ];
        for (e, want) in cases {
            assert_eq!(errno(&e), want, "{e:?}");
        }
    }
}
