//! The one table of the node's routes: every path and method the API answers, and the handler
//! (in this folder, one file per resource) that parses it and calls the node.

use std::sync::Arc;

use axum::middleware;
use axum::routing::{get, post};
use axum::Router;

use super::{
    checkpoints, edge, files, function_routes, images, node_routes, run, sandboxes, secrets,
    terminal, volumes, AppState,
};

/// The router of the node's API.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        // The node.
        .route("/healthz", get(node_routes::healthz))
        .route("/internal/node", get(node_routes::node_info))
        .route(
            "/internal/templates",
            post(sandboxes::build_template).get(sandboxes::list_templates),
        )
        // One-shot runs.
        .route("/v1/run", post(run::run))
        // Kept sandboxes and their commands.
        .route(
            "/v1/sandboxes",
            post(sandboxes::create).get(sandboxes::list),
        )
        .route(
            "/v1/sandboxes/{id}",
            get(sandboxes::get_one)
                .patch(sandboxes::patch)
                .delete(sandboxes::delete),
        )
        .route("/v1/sandboxes/{id}/restart", post(sandboxes::restart))
        // Sleep, wake, snapshots and forks.
        .route("/v1/sandboxes/{id}/sleep", post(checkpoints::sleep))
        .route("/v1/sandboxes/{id}/wake", post(checkpoints::wake))
        .route("/v1/sandboxes/{id}/snapshots", post(checkpoints::snapshot))
        .route("/v1/sandboxes/{id}/fork", post(checkpoints::fork))
        .route("/v1/snapshots", get(checkpoints::list))
        .route(
            "/v1/snapshots/{id}",
            get(checkpoints::get_one).delete(checkpoints::delete),
        )
        // Volumes.
        .route("/v1/volumes", post(volumes::create).get(volumes::list))
        .route(
            "/v1/volumes/{id}",
            get(volumes::get_one).delete(volumes::delete),
        )
        .route(
            "/v1/sandboxes/{id}/exec",
            post(sandboxes::exec).get(sandboxes::exec_list),
        )
        .route("/v1/sandboxes/{id}/run", post(sandboxes::run))
        .route(
            "/v1/sandboxes/{id}/exec/{exec_id}",
            get(sandboxes::exec_get),
        )
        .route(
            "/v1/sandboxes/{id}/exec/{exec_id}/output",
            get(sandboxes::output),
        )
        .route(
            "/v1/sandboxes/{id}/exec/{exec_id}/stdin",
            post(sandboxes::stdin),
        )
        .route(
            "/v1/sandboxes/{id}/exec/{exec_id}/signal",
            post(sandboxes::signal),
        )
        .route(
            "/v1/sandboxes/{id}/exec/{exec_id}/terminal",
            get(terminal::terminal),
        )
        // A sandbox's files.
        .route(
            "/v1/sandboxes/{id}/files",
            get(files::download).put(files::upload),
        )
        .route("/v1/sandboxes/{id}/files/list", get(files::list))
        .route("/v1/sandboxes/{id}/files/stat", get(files::stat))
        .route("/v1/sandboxes/{id}/files/mkdir", post(files::mkdir))
        .route("/v1/sandboxes/{id}/files/rm", post(files::rm))
        .route("/v1/sandboxes/{id}/files/mv", post(files::mv))
        .route("/v1/sandboxes/{id}/files/chmod", post(files::chmod))
        .route("/v1/sandboxes/{id}/files/grep", post(files::grep))
        .route("/v1/sandboxes/{id}/files/sed", post(files::sed))
        .route(
            "/v1/sandboxes/{id}/files/tar",
            get(files::tar_down).post(files::tar_up),
        )
        // Images and secrets.
        .route("/v1/images", get(images::list))
        .route("/v1/images/pull", post(images::pull))
        .route("/v1/secrets", get(secrets::list))
        .route(
            "/v1/secrets/{name}",
            get(secrets::get_one)
                .put(secrets::put)
                .delete(secrets::delete),
        )
        // The functions interface.
        .route("/v1/functions/{function_id}", post(function_routes::call))
        .fallback(node_routes::not_found)
        .method_not_allowed_fallback(node_routes::method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), edge::edge))
        .with_state(state)
}
