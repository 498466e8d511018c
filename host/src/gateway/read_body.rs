//! Reading a request body into memory, never past a limit.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use bytes::Bytes;
use http_body::Body;
use http_body_util::BodyExt;

use crate::gateway::body_limit::BodyTooLarge;
use crate::gateway::body_memory::{BodyMemory, NoRoom, Room};
use crate::gateway::client_body::BoxError;
use crate::unpoisoned::LockUnpoisoned as _;

/// Why a body could not be read.
#[derive(Debug)]
pub enum ReadBodyError {
    /// The body is longer than the limit; reading stopped there.
    TooLarge,
    /// The body stream failed (client went away, bad chunking, ...).
    Failed(String),
    /// The body outgrew the room it took in the gateway's body memory, and
    /// no more was free; reading stopped there.
    NoRoom(NoRoom),
}

/// Reads `body` whole, stopping with [`ReadBodyError::TooLarge`] as soon as
/// more than `limit` bytes have arrived, or when the body itself fails with
/// [`BodyTooLarge`] (a smaller limit before this reader). A body of known
/// length (`Content-Length`) is read into a buffer of that size, not one
/// grown as the chunks come and then copied.
pub async fn read_limited<B>(body: B, limit: usize) -> Result<Bytes, ReadBodyError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let known = body
        .size_hint()
        .exact()
        .and_then(|length| usize::try_from(length).ok());
    read(body, limit, known, None).await
}

/// What a body read into the body memory counts as it arrives, for whoever
/// times the read or judges its room (see
/// [`body_pace`](crate::gateway::body_pace)).
#[derive(Debug, Default)]
pub struct ReadProgress {
    /// The bytes that have arrived.
    pub arrived: AtomicUsize,
    /// The bytes the read holds for them: a body that came in several
    /// chunks is copied into a buffer that grows by half again, to as much
    /// as half again what has arrived.
    pub buffered: AtomicUsize,
}

/// [`read_limited`], with room in `memory` for every byte: a byte past what
/// `room` holds takes more room as it arrives where that is free at once
/// ([`BodyMemory::grow_now`]), or the read stops with
/// [`ReadBodyError::NoRoom`]. `declared` is the body's declared length,
/// which sizes its buffer at once. The bytes read so far, and those held
/// for them, are counted in `progress`, for whoever times the read (see
/// [`body_pace`](crate::gateway::body_pace)), which may give back some of
/// `room` meanwhile.
pub async fn read_limited_in<B>(
    body: B,
    limit: usize,
    declared: Option<usize>,
    memory: &BodyMemory,
    room: &Mutex<Room>,
    progress: &ReadProgress,
) -> Result<Bytes, ReadBodyError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    read(body, limit, declared, Some((memory, room, progress))).await
}

/// The room a body read by [`read_limited_in`] must keep once read: its
/// length, or the buffer it is held in where that is larger (kept where
/// copying it to size found no room).
pub fn room_after_read(body: &Bytes, progress: &ReadProgress) -> usize {
    body.len().max(progress.buffered.load(Ordering::Relaxed))
}

/// How much larger a body's buffer grows each time it is outgrown: half
/// again, so that what it holds beyond the body (which its room counts) is
/// at most a third of it.
const GROWTH_DIVISOR: usize = 2;

/// Reads the body; with `memory`, its room holds what the read holds
/// between chunks: the first chunk, kept without a copy, or, once a second
/// comes, the buffer they are gathered in, its whole capacity (grown by
/// half again where that is free, else within the room held; or to the
/// declared length at once), taken before the buffer grows. A buffer that
/// ends more than a quarter larger than its body is copied to its size
/// where room for both is free, and the room is then shrunk to the body.
/// What the read holds in the end is left in `progress.buffered`, below
/// which its room must not be shrunk. (While a buffer is outgrown, it and
/// its larger successor both exist for the moment of the copy: that is not
/// counted.)
async fn read<B>(
    body: B,
    limit: usize,
    declared: Option<usize>,
    memory: Option<(&BodyMemory, &Mutex<Room>, &ReadProgress)>,
) -> Result<Bytes, ReadBodyError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    // What the room holds now (all there is, without one).
    let room_bytes = || memory.map_or(usize::MAX, |(_, room, _)| room.lock_unpoisoned().bytes());
    // The room holds at least `bytes`, or the read stops.
    let hold = |bytes: usize| -> Result<(), ReadBodyError> {
        if let Some((memory, room, _)) = memory {
            // Shared with the body's pace, which may give some back; never
            // held across an await.
            let mut room = room.lock_unpoisoned();
            if bytes > room.bytes() {
                let more = bytes - room.bytes();
                memory
                    .grow_now(&mut room, more)
                    .map_err(ReadBodyError::NoRoom)?;
            }
        }
        Ok(())
    };
    let mut body = std::pin::pin!(body);
    let mut first: Option<Bytes> = None;
    let mut buffer: Vec<u8> = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            let e: BoxError = e.into();
            if e.is::<BodyTooLarge>() {
                ReadBodyError::TooLarge
            } else {
                // hyper's own words ("error reading a body from
                // connection") do not say what was wrong; its causes do.
                ReadBodyError::Failed(crate::gateway::error_chain::describe(&*e))
            }
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        }; // trailers
        let first_len = first.as_ref().map_or(0, Bytes::len);
        let needed = first_len + buffer.len() + data.len();
        if needed > limit {
            return Err(ReadBodyError::TooLarge);
        }
        if let Some((_, _, progress)) = memory {
            progress.arrived.store(needed, Ordering::Relaxed);
        }
        // One chunk (the usual case for small bodies) needs no copy.
        if first.is_none() && buffer.is_empty() {
            hold(needed)?;
            first = Some(data);
        } else {
            if needed > buffer.capacity() {
                let grown = buffer.capacity() + buffer.capacity() / GROWTH_DIVISOR;
                let expected = declared.unwrap_or(0);
                let wanted = grown.max(expected).min(limit).max(needed);
                // Half again where that is free; else as far as the room
                // held already goes (while requests wait for room, none is
                // free), and the body stops only where what has arrived
                // outgrows it.
                let capacity = match hold(wanted) {
                    Ok(()) => wanted,
                    Err(_) => {
                        let within = needed.max(room_bytes().min(wanted));
                        hold(within)?;
                        within
                    }
                };
                buffer.reserve_exact(capacity - buffer.len());
            }
            if let Some(chunk) = first.take() {
                buffer.extend_from_slice(&chunk);
            }
            buffer.extend_from_slice(&data);
        }
        if let Some((_, _, progress)) = memory {
            let held = first.as_ref().map_or(0, Bytes::len) + buffer.capacity();
            progress.buffered.store(held, Ordering::Relaxed);
        }
    }
    if first.is_some() || buffer.capacity() <= buffer.len() + buffer.len() / 4 {
        return Ok(first.unwrap_or_else(|| Bytes::from(buffer)));
    }
    if hold(buffer.capacity() + buffer.len()).is_err() {
        return Ok(Bytes::from(buffer));
    }
    let exact = Bytes::copy_from_slice(&buffer);
    drop(buffer);
    if let Some((_, room, progress)) = memory {
        room.lock_unpoisoned().shrink_to(exact.len());
        progress.buffered.store(exact.len(), Ordering::Relaxed);
    }
    Ok(exact)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use http_body_util::Full;
    use std::collections::VecDeque;
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll};
    use std::time::Duration;

    /// A body that yields the given chunks one frame at a time (also for
    /// the body limit's tests).
    pub(crate) struct Chunks(VecDeque<&'static [u8]>);

    impl Body for Chunks {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            Poll::Ready(
                self.0
                    .pop_front()
                    .map(|c| Ok(http_body::Frame::data(Bytes::from_static(c)))),
            )
        }
    }

    pub(crate) fn chunks(parts: &[&'static [u8]]) -> Chunks {
        Chunks(parts.iter().copied().collect())
    }

    #[tokio::test]
    async fn reads_chunks_up_to_the_limit_and_refuses_beyond() {
        let whole = read_limited(chunks(&[b"ab", b"cd", b"e"]), 5)
            .await
            .expect("within the limit");
        assert_eq!(&whole[..], b"abcde");
        assert!(matches!(
            read_limited(chunks(&[b"ab", b"cd", b"ef"]), 5).await,
            Err(ReadBodyError::TooLarge)
        ));
        let one = read_limited(Full::new(Bytes::from_static(b"{}")), 2)
            .await
            .expect("one chunk");
        assert_eq!(&one[..], b"{}");
    }

    const KIB: &[u8] = &[b'x'; 1024];

    #[tokio::test]
    async fn takes_room_for_every_byte_past_what_it_held() {
        let memory = BodyMemory::new(4 << 10, Duration::from_secs(1));
        let room = Mutex::new(memory.reserve(1024, || None).await.expect("room"));
        let progress = ReadProgress::default();
        let whole = read_limited_in(
            chunks(&[KIB, KIB, b"x"]),
            8 << 10,
            None,
            &memory,
            &room,
            &progress,
        )
        .await
        .expect("within the memory");
        assert_eq!(whole.len(), 2049);
        assert_eq!(
            progress.arrived.load(Ordering::Relaxed),
            2049,
            "the bytes counted"
        );
        let buffered = progress.buffered.load(Ordering::Relaxed);
        assert!((2049..=2 * 2049).contains(&buffered), "{buffered} held");
        assert_eq!(room.lock().unwrap().bytes(), 3 << 10);
        assert_eq!(memory.held(), 3 << 10);
    }

    #[tokio::test]
    async fn a_body_in_chunks_holds_no_more_than_a_quarter_over_its_length() {
        let memory = BodyMemory::new(1 << 20, Duration::from_secs(1));
        let parts: Vec<&'static [u8]> = vec![KIB; 5];
        for declared in [Some(5 << 10), None] {
            let room = Mutex::new(memory.reserve(5 << 10, || None).await.expect("room"));
            let whole = read_limited_in(
                chunks(&parts),
                1 << 20,
                declared,
                &memory,
                &room,
                &ReadProgress::default(),
            )
            .await
            .expect("within the limits");
            let whole = Vec::from(whole);
            assert_eq!(whole.len(), 5 << 10);
            assert!(
                whole.capacity() <= (5 << 10) * 5 / 4,
                "{}",
                whole.capacity()
            );
        }
    }

    /// A body without a declared length, in chunks, holds no more than
    /// its room between chunks: the room counts its buffer's capacity,
    /// taken before the buffer grows, not only the bytes that arrived.
    /// Before, a buffer grown by doubling held up to twice its room, and the
    /// copy to the body's size at the end was not counted: 100 such 8 MiB
    /// bodies held 905 MiB where the body memory was 512 MiB.
    #[tokio::test]
    async fn a_body_of_no_declared_length_holds_no_more_than_its_room() {
        /// Chunks that, at each poll, see that the room holds what the read
        /// held after the chunk before.
        struct Watched {
            chunks: Chunks,
            room: Arc<Mutex<Room>>,
            progress: Arc<ReadProgress>,
        }
        impl Body for Watched {
            type Data = Bytes;
            type Error = std::convert::Infallible;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
                let held = self.progress.buffered.load(Ordering::Relaxed);
                let room = self.room.lock().unwrap().bytes();
                assert!(held <= room, "{held} bytes held in {room} of room");
                Pin::new(&mut self.chunks).poll_frame(cx)
            }
        }
        const CHUNK: &[u8] = &[b'x'; 100 << 10];
        let memory = BodyMemory::new(64 << 20, Duration::from_secs(1));
        let room = Arc::new(Mutex::new(Room::none()));
        let progress = Arc::new(ReadProgress::default());
        let body = Watched {
            chunks: chunks(&[CHUNK; 83]),
            room: room.clone(),
            progress: progress.clone(),
        };
        let whole = read_limited_in(body, 32 << 20, None, &memory, &room, &progress)
            .await
            .expect("within the limits");
        assert_eq!(whole.len(), 83 * (100 << 10));
        // The buffer was copied to the body's size, and the room shrunk to
        // it.
        let held = room.lock().unwrap().bytes();
        assert_eq!(held, whole.len());
        assert_eq!(memory.held(), held);
        let whole = Vec::from(whole);
        assert_eq!(whole.capacity(), whole.len());
    }

    /// Where no more room is free (requests wait for it), a body of no
    /// declared length grows its buffer within the room it holds, and is
    /// read whole while what arrives fits that room; it is left holding
    /// its buffer, which its room still counts. Before, the buffer asked
    /// for half again, found none free, and a 900 KiB body in a 1 MiB room
    /// got 503.
    #[tokio::test]
    async fn a_body_grows_within_its_room_where_no_more_is_free() {
        const CHUNK: &[u8] = &[b'x'; 16 << 10];
        let memory = BodyMemory::new(1 << 20, Duration::from_secs(1));
        let room = Mutex::new(memory.reserve(1 << 20, || None).await.expect("room"));
        let progress = ReadProgress::default();
        let whole = read_limited_in(
            chunks(&[CHUNK; 56]),
            32 << 20,
            None,
            &memory,
            &room,
            &progress,
        )
        .await
        .expect("within its room");
        assert_eq!(whole.len(), 56 * (16 << 10));
        // No room for a copy to size: the body stays in its buffer, larger
        // than it, which the room kept after the read still counts.
        let held = progress.buffered.load(Ordering::Relaxed);
        assert!(held > whole.len(), "{held} held for {}", whole.len());
        assert_eq!(room_after_read(&whole, &progress), held);
        assert!(room.lock().unwrap().bytes() >= held);
        assert_eq!(memory.held(), 1 << 20);
    }

    #[tokio::test]
    async fn stops_where_no_room_is_free_and_keeps_what_it_took() {
        let memory = BodyMemory::new(2 << 10, Duration::from_secs(3600));
        let room = Mutex::new(Room::none());
        let refused = read_limited_in(
            chunks(&[KIB, KIB, KIB]),
            8 << 10,
            None,
            &memory,
            &room,
            &ReadProgress::default(),
        )
        .await;
        assert!(
            matches!(
                refused,
                Err(ReadBodyError::NoRoom(NoRoom { limit: 2048, .. }))
            ),
            "{refused:?}"
        );
        assert_eq!(room.lock().unwrap().bytes(), 2 << 10);
    }
}
