//! Locks taken whether or not a thread panicked while holding them.
//!
//! For locks over state a panic cannot leave half changed (values replaced
//! whole: counts, marks, queues, the last error): a poisoned one says
//! nothing about that state, and a panic in one request must not become a
//! panic in every later one.

use std::sync::{Mutex, MutexGuard};

/// [`Mutex::lock`], taking the guard from a poisoned lock too.
pub(crate) trait LockUnpoisoned<T> {
    /// Locks, whether or not the lock is poisoned.
    fn lock_unpoisoned(&self) -> MutexGuard<'_, T>;
}

impl<T> LockUnpoisoned<T> for Mutex<T> {
    fn lock_unpoisoned(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
