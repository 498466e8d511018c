//! A request body streamed through to the upstream, cut off at the body
//! limit: one that declared no length (chunked) is refused as soon as it
//! passes the limit, as a body read into memory for the plugin is.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{Method, Uri};
use http_body::{Body, Frame, SizeHint};

use crate::gateway::client_body::{BodyProgress, BoxError};
use crate::log_throttle::LogThrottle;

/// A body that fails with [`BodyTooLarge`] once more than its limit has
/// come through.
pub struct Capped<B> {
    inner: B,
    limit: u64,
    /// Data bytes handed out so far.
    passed: u64,
    /// The request to name in a warning if the body is cut off after its
    /// answer came; taken when the warning is written.
    late_cut: Option<LateCut>,
}

impl<B> Capped<B> {
    /// `inner`, at most `limit` bytes of it.
    pub fn new(inner: B, limit: usize) -> Capped<B> {
        Capped {
            inner,
            limit: limit as u64,
            passed: 0,
            late_cut: None,
        }
    }

    /// The same, warning, with `method` and `target`, when it is cut off
    /// after `progress` says its answer came: the client then had its
    /// answer (the upstream's, which came before its whole body) and no 413
    /// can tell it, and the upstream saw the body end short. Without a
    /// progress (a request no gateway server made), nothing tells.
    pub fn warning_when_cut_after_answer(
        mut self,
        progress: Option<Arc<BodyProgress>>,
        method: Method,
        target: Uri,
    ) -> Capped<B> {
        self.late_cut = progress.map(|progress| LateCut {
            progress,
            method,
            target,
        });
        self
    }

    /// A body past the limit: warned of, where its answer already came.
    fn too_large(&mut self) -> BoxError {
        if let Some(late) = self.late_cut.take_if(|late| late.progress.was_answered()) {
            static CUT_AFTER_ANSWER: LogThrottle = LogThrottle::new();
            if let Some(held_back) = CUT_AFTER_ANSWER.admit() {
                // Quoted and escaped, as the access log has it: a client's
                // path may hold line and paragraph separators.
                let path = late.target.to_string();
                tracing::warn!(
                    method = %late.method,
                    path = path.as_str(),
                    "a request body streamed through passed --max-body-bytes ({} bytes) after \
                     the upstream had answered it: the upstream saw it cut off, and its client had \
                     the answer and then a closed connection {held_back}",
                    self.limit
                );
            }
        }
        Box::new(BodyTooLarge { limit: self.limit })
    }
}

/// The request a body cut off after its answer belongs to.
struct LateCut {
    progress: Arc<BodyProgress>,
    method: Method,
    target: Uri,
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
            return Poll::Ready(Some(Err(this.too_large())));
        }
        let frame = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
            None => return Poll::Ready(None),
        };
        if let Some(data) = frame.data_ref() {
            this.passed += data.len() as u64;
            if this.passed > this.limit {
                return Poll::Ready(Some(Err(this.too_large())));
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
