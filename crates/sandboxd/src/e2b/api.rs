//! E2B's control plane: sandboxes made, listed, found, timed and killed.

use std::sync::Arc;

use crate::node::Node;

pub(crate) fn router(node: Arc<Node>) -> axum::Router {
    let _ = node;
    axum::Router::new()
}
