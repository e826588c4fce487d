//! Failures the caller can do nothing about, shared by the node and its agent client.

use sbx_api::ApiError;

/// `map_err` for a failure the caller can do nothing about: logged with its cause (`what`
/// failed), answered 500 internal, whose message sends the reader to the log.
pub fn internal<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> ApiError {
    move |e| {
        tracing::error!(error = %e, "{what}");
        ApiError::internal()
    }
}

/// A failure of the state database: logged, answered 500 internal.
pub fn store_err(e: crate::store::StoreError) -> ApiError {
    tracing::error!(error = %e, "state database");
    ApiError::internal()
}
