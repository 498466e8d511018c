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
//! on purpose cannot be made without about 2^32 hashes a pair, but the
//! hash's keys are fixed and public, so pairs can be made ahead: a key
//! whose hash another held key has is held apart, in a list for that hash,
//! looked through only by keys of that hash (a key of any other hash costs
//! nothing more). One list for all of them, looked through by every key,
//! let a body of a thousand such pairs and millions of short keys after
//! them run past the deadline.
//!
//! What a key is held as by hash is up to the walk: the JSON walk holds
//! its text; the MessagePack walk holds where it is in the body, and reads
//! it again when a key of the same hash comes. A map of a million keys
//! over params, each held until the map ends, took six times its body in
//! memory when each B-tree entry held the key's value (56 bytes in wasm,
//! 20 now).
//!
//! The B-trees are fields, not boxed until a second key (and dropped by
//! hand): natively that saved 460 instructions of a 1 KiB chat request,
//! but the plugin runs as wasm, where it cost 300 more (`bench/instructions.sh`),
//! and a 32 MiB body of empty maps or objects took as long either way.

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher, Hash};
use std::ops::Range;

/// Edit ranges by key: the key held singly as a `K`, compared with each
/// key read, and the others as an `M` by their hash.
pub(crate) struct EditsByKey<K, M = K> {
    /// How many keys are held: most objects hold none, and each key read
    /// asks, so that is the one comparison on their way.
    held: usize,
    /// The first key given edits while no other was held.
    one: Option<(K, Range<usize>)>,
    /// A key of each hash, the first given edits, for every other key.
    /// (Not made until its first key: `BTreeMap::new` allocates nothing.)
    more: BTreeMap<u64, (M, Range<usize>)>,
    /// Keys whose hash another key held in `more` has, by that hash:
    /// every hash here is one of `more`'s too.
    collided: BTreeMap<u64, Vec<(M, Range<usize>)>>,
    /// How many keys held in `collided` lookups compared: the work that
    /// keys of a hash no key collides on must not cause.
    #[cfg(test)]
    compared: usize,
}

/// SipHash-1-3 with fixed keys: the same hashes in every instance.
pub(crate) fn hash_of<Q: Hash + ?Sized>(key: &Q) -> u64 {
    BuildHasherDefault::<DefaultHasher>::default().hash_one(key)
}

impl<K, M> EditsByKey<K, M> {
    /// None yet (nothing allocated).
    #[inline(always)]
    pub(crate) fn new() -> EditsByKey<K, M> {
        EditsByKey {
            held: 0,
            one: None,
            more: BTreeMap::new(),
            collided: BTreeMap::new(),
            #[cfg(test)]
            compared: 0,
        }
    }

    /// Whether no key is held.
    #[inline(always)]
    pub(crate) fn is_empty(&self) -> bool {
        self.held == 0
    }

    /// The edits held under a key, taken out: a duplicate of it came.
    /// `same_one` says whether the key held singly is it, `hash` gives its
    /// hash (asked only when keys are held by hash), and `same` says
    /// whether a key held by that hash is it.
    #[inline]
    pub(crate) fn remove_by(
        &mut self,
        same_one: impl FnOnce(&K) -> bool,
        hash: impl FnOnce() -> u64,
        same: impl FnMut(&M) -> bool,
    ) -> Option<Range<usize>> {
        if self.held == 0 {
            return None;
        }
        let found = self.find(same_one, hash, same);
        self.held -= usize::from(found.is_some());
        found
    }

    /// [`EditsByKey::remove_by`] once some key is held: out of the way of
    /// the objects that hold none.
    #[inline(never)]
    fn find(
        &mut self,
        same_one: impl FnOnce(&K) -> bool,
        hash: impl FnOnce() -> u64,
        mut same: impl FnMut(&M) -> bool,
    ) -> Option<Range<usize>> {
        if self.one.as_ref().is_some_and(|(held, _)| same_one(held)) {
            return self.one.take().map(|(_, range)| range);
        }
        if self.more.is_empty() {
            return None;
        }
        let hash = hash();
        // No key held by this hash, so none held apart for it either.
        let (held, _) = self.more.get(&hash)?;
        if same(held) {
            let (_, range) = self.more.remove(&hash)?;
            // A key held apart for the hash takes the place.
            if let Some(apart) = self.collided.get_mut(&hash) {
                if let Some(next) = apart.pop() {
                    self.more.insert(hash, next);
                }
                if apart.is_empty() {
                    self.collided.remove(&hash);
                }
            }
            return Some(range);
        }
        let apart = self.collided.get_mut(&hash)?;
        #[cfg(test)]
        {
            self.compared += apart.len();
        }
        let at = apart.iter().position(|(held, _)| same(held))?;
        let (_, range) = apart.swap_remove(at);
        if apart.is_empty() {
            self.collided.remove(&hash);
        }
        Some(range)
    }

    /// Holds `range`, the edits of `key`'s value, until a duplicate of it
    /// comes: singly when no other key is held, else as what `by_hash`
    /// makes of it, its hash and what is held. `key` is held by none:
    /// [`EditsByKey::remove_by`] took it out.
    #[inline(never)]
    pub(crate) fn insert_by(
        &mut self,
        key: K,
        by_hash: impl FnOnce(K) -> (u64, M),
        range: Range<usize>,
    ) {
        self.held += 1;
        if self.one.is_none() && self.more.is_empty() {
            self.one = Some((key, range));
            return;
        }
        let (hash, held) = by_hash(key);
        match self.more.entry(hash) {
            std::collections::btree_map::Entry::Vacant(slot) => {
                slot.insert((held, range));
            }
            std::collections::btree_map::Entry::Occupied(_) => {
                self.collided.entry(hash).or_default().push((held, range))
            }
        }
    }
}

impl<K: Hash + Eq> EditsByKey<K> {
    /// The edits held under `key`, taken out: a duplicate of it came.
    #[inline]
    pub(crate) fn remove<Q>(&mut self, key: &Q) -> Option<Range<usize>>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.remove_by(
            |held| held.borrow() == key,
            || hash_of(key),
            |held| held.borrow() == key,
        )
    }

    /// Holds `range`, the edits of `key`'s value, until a duplicate of it
    /// comes. `key` is held by none: [`EditsByKey::remove`] took it out.
    #[inline]
    pub(crate) fn insert(&mut self, key: K, range: Range<usize>) {
        self.insert_by(key, |key| (hash_of(&key), key), range)
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

    /// The keys held, singly, by hash and apart, are dropped with the
    /// edits' holder, once.
    #[test]
    fn held_keys_are_dropped_with_it() {
        let key = std::rc::Rc::new(7u32);
        let mut edits = EditsByKey::new();
        edits.insert(key.clone(), 0..1);
        drop(edits);
        assert_eq!(std::rc::Rc::strong_count(&key), 1);
        // Singly, by hash 0, apart (hash 0 again), by hash 1.
        let mut held = EditsByKey::<_, std::rc::Rc<u32>>::new();
        for hash in [0, 0, 0, 1] {
            held.insert_by(key.clone(), |key| (hash, key), 0..1);
        }
        assert_eq!(held.collided.len(), 1);
        assert_eq!(std::rc::Rc::strong_count(&key), 5);
        drop(held);
        assert_eq!(std::rc::Rc::strong_count(&key), 1);
        // One that held nothing.
        drop(EditsByKey::<String>::new());
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

    /// A key that hashes as its `hash` says.
    #[derive(PartialEq, Eq)]
    struct Hashed {
        hash: u64,
        name: u32,
    }

    impl Hash for Hashed {
        fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
            state.write_u64(self.hash)
        }
    }

    /// Keys held apart for colliding hashes are compared only with keys of
    /// those hashes: a thousand pairs made ahead cost nothing to the
    /// thousands of other keys that follow them, and each pair is still
    /// told apart.
    #[test]
    fn keys_held_apart_cost_only_keys_of_their_hash() {
        let mut edits = EditsByKey::new();
        let key = |hash, name| Hashed { hash, name };
        for pair in 0..1000 {
            edits.insert(key(pair, 0), 0..1);
            edits.insert(key(pair, 1), 1..2);
        }
        assert_eq!(edits.collided.len(), 999, "the first of all is held singly");
        for other in 1000..11_000 {
            assert_eq!(edits.remove(&key(other, 0)), None);
        }
        assert_eq!(edits.compared, 0, "keys of other hashes compared");
        // A key of a colliding hash is compared with that hash's only.
        assert_eq!(edits.remove(&key(500, 7)), None);
        assert_eq!(edits.compared, 1);
        // Either of a pair leaves first; the other is still found.
        assert_eq!(edits.remove(&key(500, 0)), Some(0..1));
        assert_eq!(edits.remove(&key(500, 1)), Some(1..2));
        assert_eq!(edits.remove(&key(501, 1)), Some(1..2));
        assert_eq!(edits.remove(&key(501, 0)), Some(0..1));
        for hash in [500, 501] {
            assert!(!edits.collided.contains_key(&hash_of(&key(hash, 0))));
        }
        assert_eq!(edits.remove(&key(500, 0)), None);
    }
}
