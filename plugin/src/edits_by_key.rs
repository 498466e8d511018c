//! The edits under each key of one object (or map) that a later duplicate
//! key cancels: what both walks keep while they read an object, so that
//! the last of duplicate keys wins.
//!
//! Most objects have one key whose value holds edits (`disaggregated_params`)
//! or none: that one is held as it is and compared with each later key.
//! Past one, keys are held in an ordered map by their hash (SipHash with
//! fixed keys), so that finding a duplicate costs a hash of the key, a few
//! comparisons of hashes and, on a match, one of keys. The ordered map
//! used to order the keys themselves, and compared each key with a dozen
//! others byte by byte: a 32 MiB body of keys sharing a long prefix, each
//! over params, then ran past the plugin's deadline. (A hash table would
//! grow by doubling, and the plugin's arena keeps every table it outgrew:
//! more memory than the ordered map, which grows by nodes.) Keys colliding
//! on purpose cannot be made without about 2^32 hashes a pair; the second of
//! a pair is held in a list, looked through only by keys of that hash.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher, Hash};
use std::ops::Range;

/// Edit ranges by key.
pub(crate) struct EditsByKey<K> {
    /// How many keys are held: most objects hold none, and each key read
    /// asks, so that is the one comparison on their way.
    held: usize,
    /// The first key given edits while no other was held.
    one: Option<(K, Range<usize>)>,
    /// Every other key given edits, by its hash.
    more: BTreeMap<u64, (K, Range<usize>)>,
    /// Keys whose hash another key held in `more` has.
    collided: Vec<(u64, K, Range<usize>)>,
}

/// SipHash-1-3 with fixed keys: the same hashes in every instance.
fn hash_of<Q: Hash + ?Sized>(key: &Q) -> u64 {
    BuildHasherDefault::<DefaultHasher>::default().hash_one(key)
}

impl<K: Hash + Eq> EditsByKey<K> {
    /// None yet (nothing allocated).
    pub(crate) fn new() -> EditsByKey<K> {
        EditsByKey {
            held: 0,
            one: None,
            more: BTreeMap::new(),
            collided: Vec::new(),
        }
    }

    /// The edits held under `key`, taken out: a duplicate of it came.
    #[inline]
    pub(crate) fn remove<Q>(&mut self, key: &Q) -> Option<Range<usize>>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if self.held == 0 {
            return None;
        }
        let found = self.find(key);
        self.held -= usize::from(found.is_some());
        found
    }

    /// [`EditsByKey::remove`] once some key is held: out of the way of
    /// the objects that hold none.
    #[inline(never)]
    fn find<Q>(&mut self, key: &Q) -> Option<Range<usize>>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if self
            .one
            .as_ref()
            .is_some_and(|(held, _)| held.borrow() == key)
        {
            return self.one.take().map(|(_, range)| range);
        }
        if self.more.is_empty() && self.collided.is_empty() {
            return None;
        }
        let hash = hash_of(key);
        if self
            .more
            .get(&hash)
            .is_some_and(|(held, _)| held.borrow() == key)
        {
            return self.more.remove(&hash).map(|(_, range)| range);
        }
        if self.collided.is_empty() {
            return None;
        }
        let at = self
            .collided
            .iter()
            .position(|(h, held, _)| *h == hash && held.borrow() == key)?;
        Some(self.collided.swap_remove(at).2)
    }

    /// Holds `range`, the edits of `key`'s value, until a duplicate of it
    /// comes. `key` is held by none: [`EditsByKey::remove`] took it out.
    #[inline(never)]
    pub(crate) fn insert(&mut self, key: K, range: Range<usize>) {
        self.held += 1;
        if self.one.is_none() && self.more.is_empty() {
            self.one = Some((key, range));
            return;
        }
        let hash = hash_of(&key);
        match self.more.entry(hash) {
            std::collections::btree_map::Entry::Vacant(slot) => {
                slot.insert((key, range));
            }
            std::collections::btree_map::Entry::Occupied(_) => {
                self.collided.push((hash, key, range))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys held singly or in the map are found and taken out once; others
    /// are not found.
    #[test]
    fn keys_are_found_once_wherever_they_are_held() {
        let mut edits = EditsByKey::new();
        assert_eq!(edits.remove(&"a"), None);
        edits.insert("a", 0..1);
        edits.insert("b", 1..2);
        edits.insert("c", 2..4);
        assert_eq!(edits.remove(&"z"), None);
        assert_eq!(edits.remove(&"b"), Some(1..2));
        assert_eq!(edits.remove(&"b"), None);
        assert_eq!(edits.remove(&"a"), Some(0..1));
        assert_eq!(edits.remove(&"a"), None);
        // The single slot is free again, but the map still holds "c".
        edits.insert("d", 4..5);
        assert_eq!(edits.remove(&"c"), Some(2..4));
        assert_eq!(edits.remove(&"d"), Some(4..5));
        assert_eq!(edits.remove(&"d"), None);
    }

    /// Keys that all hash alike: every one past the first two is held as
    /// a collision.
    #[derive(PartialEq, Eq)]
    struct Colliding(u32);

    impl Hash for Colliding {
        fn hash<H: std::hash::Hasher>(&self, _: &mut H) {}
    }

    /// Keys of one hash are still told apart, found once each, whichever
    /// of them leaves first.
    #[test]
    fn keys_of_one_hash_are_told_apart() {
        let mut edits = EditsByKey::new();
        for n in 0..5 {
            edits.insert(Colliding(n), n as usize..n as usize + 1);
        }
        assert_eq!(edits.remove(&Colliding(9)), None);
        // The one held by hash leaves first; the collisions stay found.
        assert_eq!(edits.remove(&Colliding(1)), Some(1..2));
        assert_eq!(edits.remove(&Colliding(3)), Some(3..4));
        assert_eq!(edits.remove(&Colliding(1)), None);
        // A key of the hash no longer held by hash goes there again.
        edits.insert(Colliding(7), 7..8);
        for n in [4, 2, 0, 7] {
            assert_eq!(
                edits.remove(&Colliding(n)),
                Some(n as usize..n as usize + 1),
                "{n}"
            );
        }
        for n in 0..8 {
            assert_eq!(edits.remove(&Colliding(n)), None, "{n}");
        }
    }
}
