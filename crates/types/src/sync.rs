//! The one policy for poisoned locks: take the guard anyway.
//!
//! A lock is poisoned when a thread panicked while holding it. The panic itself is the report of
//! that bug (it is logged, and the task that hit it ends); the node's other tasks carry on with the
//! protected value rather than panicking in turn or silently skipping their work. The rule that
//! makes this sound: a critical section is short and never leaves the value half-updated across a
//! call that can panic. Every `Mutex` and `RwLock` in the workspace is taken through these
//! functions.

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Locks `m`, recovering the guard of a poisoned lock.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Read-locks `l`, recovering the guard of a poisoned lock.
pub fn read<T: ?Sized>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(PoisonError::into_inner)
}

/// Write-locks `l`, recovering the guard of a poisoned lock.
pub fn write<T: ?Sized>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_still_gives_its_value() {
        let m = std::sync::Arc::new(Mutex::new(7));
        let m2 = m.clone();
        let r = std::thread::spawn(move || {
            let _g = lock(&m2);
            panic!("poison it");
        })
        .join();
        assert!(r.is_err());
        assert!(m.is_poisoned());
        assert_eq!(*lock(&m), 7);

        let l = std::sync::Arc::new(RwLock::new(3));
        let l2 = l.clone();
        let r = std::thread::spawn(move || {
            let _g = write(&l2);
            panic!("poison it");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(*read(&l), 3);
        *write(&l) = 4;
        assert_eq!(*read(&l), 4);
    }
}
