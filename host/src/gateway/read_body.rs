//! Reading a request body into memory, never past a limit.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use bytes::{Bytes, BytesMut};
use http_body::Body;
use http_body_util::BodyExt;

use crate::gateway::body_limit::BodyTooLarge;
use crate::gateway::body_memory::{BodyMemory, NoRoom, Room};
use crate::gateway::client_body::BoxError;

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
/// grown by doubling and then copied, which held up to three times it.
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
    /// chunks is copied into a buffer that grows by doubling, to as much
    /// as twice what has arrived.
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

/// The body in memory takes no more than its length and a quarter: a
/// buffer grown by doubling, for a body of no declared length, is copied
/// to its size, so that the memory it holds is what its room counts.
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
    let mut body = std::pin::pin!(body);
    let mut first: Option<Bytes> = None;
    let mut buffer = BytesMut::new();
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
        let so_far = first.as_ref().map_or(0, Bytes::len) + buffer.len();
        let needed = so_far + data.len();
        if needed > limit {
            return Err(ReadBodyError::TooLarge);
        }
        if let Some((memory, room, progress)) = memory {
            // Shared with the body's pace, which may give some back; never
            // held across an await.
            let mut room = room.lock().unwrap_or_else(|p| p.into_inner());
            if needed > room.bytes() {
                let more = needed - room.bytes();
                memory
                    .grow_now(&mut room, more)
                    .map_err(ReadBodyError::NoRoom)?;
            }
            progress.arrived.store(needed, Ordering::Relaxed);
        }
        // One chunk (the usual case for small bodies) needs no copy.
        match first.take() {
            None if buffer.is_empty() => first = Some(data),
            None => buffer.extend_from_slice(&data),
            Some(chunk) => {
                let expected = declared.unwrap_or(0).min(limit);
                buffer.reserve(expected.max(chunk.len() + data.len()));
                buffer.extend_from_slice(&chunk);
                buffer.extend_from_slice(&data);
            }
        }
        if let Some((_, _, progress)) = memory {
            let held = first.as_ref().map_or(0, Bytes::len) + buffer.capacity();
            progress.buffered.store(held, Ordering::Relaxed);
        }
    }
    Ok(match first {
        Some(chunk) => chunk,
        None if buffer.capacity() > buffer.len() + buffer.len() / 4 => {
            Bytes::copy_from_slice(&buffer)
        }
        None => buffer.freeze(),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use http_body_util::Full;
    use std::collections::VecDeque;
    use std::pin::Pin;
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
