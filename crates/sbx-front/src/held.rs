//! An answer that holds its sandbox awake while its body is sent.

use axum::response::Response;

/// `resp` with `held` kept until its body has been sent (or dropped). Its size (and so its
/// Content-Length) is the body's own.
pub fn hold_while_sent(resp: Response, held: sbx_node::node::sandbox::sleep::InUse) -> Response {
    let (parts, body) = resp.into_parts();
    let cut = Box::pin(held.cut());
    Response::from_parts(
        parts,
        axum::body::Body::new(Held {
            body,
            cut,
            _held: held,
        }),
    )
}

/// A body that holds a sandbox awake while it is sent, and ends where a sleep asked for cuts
/// it.
struct Held {
    body: axum::body::Body,
    cut: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    _held: sbx_node::node::sandbox::sleep::InUse,
}

impl http_body::Body for Held {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        if self.cut.as_mut().poll(cx).is_ready() {
            return std::task::Poll::Ready(Some(Err(axum::Error::new(
                "the sandbox was put to sleep",
            ))));
        }
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
