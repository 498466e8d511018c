//! A request body streamed through to the upstream, cut off at the body
//! limit: one that declared no length (chunked) is refused as soon as it
//! passes the limit, as a body read into memory for the plugin is.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use crate::gateway::client_body::BoxError;

/// A body that fails with [`BodyTooLarge`] once more than its limit has
/// come through.
pub struct Capped<B> {
    inner: B,
    limit: u64,
    /// Data bytes handed out so far.
    passed: u64,
}

impl<B> Capped<B> {
    /// `inner`, at most `limit` bytes of it.
    pub fn new(inner: B, limit: usize) -> Capped<B> {
        Capped {
            inner,
            limit: limit as u64,
            passed: 0,
        }
    }
}

/// A request body longer than the gateway's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyTooLarge {
    /// The limit, in bytes (`--max-body-bytes`).
    pub limit: u64,
}

impl std::fmt::Display for BodyTooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the request body is larger than this gateway's limit of {} bytes",
            self.limit
        )
    }
}

impl std::error::Error for BodyTooLarge {}

impl<B> Body for Capped<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.passed > this.limit {
            return Poll::Ready(Some(Err(Box::new(BodyTooLarge { limit: this.limit }))));
        }
        let frame = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
            None => return Poll::Ready(None),
        };
        if let Some(data) = frame.data_ref() {
            this.passed += data.len() as u64;
            if this.passed > this.limit {
                return Poll::Ready(Some(Err(Box::new(BodyTooLarge { limit: this.limit }))));
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;
    use crate::gateway::read_body::tests::chunks;

    #[tokio::test]
    async fn passes_a_body_up_to_the_limit_and_fails_past_it() {
        let whole = Capped::new(chunks(&[b"ab", b"cd", b"e"]), 5)
            .collect()
            .await
            .expect("within the limit");
        assert_eq!(whole.to_bytes(), "abcde");

        let mut over = Capped::new(chunks(&[b"ab", b"cd", b"ef", b"gh"]), 5);
        assert_eq!(
            over.frame().await.unwrap().unwrap().into_data().unwrap(),
            "ab"
        );
        assert_eq!(
            over.frame().await.unwrap().unwrap().into_data().unwrap(),
            "cd"
        );
        let error = over.frame().await.unwrap().unwrap_err();
        assert_eq!(
            error.downcast_ref::<BodyTooLarge>(),
            Some(&BodyTooLarge { limit: 5 })
        );
        assert!(over.frame().await.unwrap().is_err(), "it stays failed");
    }
}
