//! The node's one lock policy for `std::sync::Mutex`: a lock poisoned by a panic elsewhere is
//! taken anyway (`PoisonError::into_inner`). Every state the node guards with one is whole
//! after each statement that changes it, so the panic left nothing half-done to refuse, and
//! skipping an update (a release, a removal, a count) would leave the node's state wrong for
//! good.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// [`Mutex::lock`] with the node's policy: never fails.
pub trait LockExt<T: ?Sized> {
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> LockExt<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_taken() {
        let m = Mutex::new(1);
        let _ = std::panic::catch_unwind(|| {
            let _g = m.lock().unwrap();
            panic!("poison");
        });
        assert!(m.is_poisoned());
        *m.locked() += 1;
        assert_eq!(*m.locked(), 2);
    }
}
