//! The one table of the node's routes: every path and method the API answers, and the handler
//! (in this folder, one file per resource) that parses it and calls the node.
//!
//! Each route is added through [`Routes`], which keeps its method and path beside the router:
//! [`table`] is what the router answers, and the tests of `openapi.rs` hold the document of
//! `GET /openapi.json` to it (every route documented, nothing documented that is not a route).

use std::sync::Arc;

use axum::handler::Handler;
use axum::http::Method;
use axum::middleware;
use axum::routing::{on, MethodFilter};
use axum::Router;

use super::{
    checkpoints, edge, files, function_routes, images, moves, node_routes, openapi, run, sandboxes,
    secrets, terminal, volumes, AppState,
};

/// The router of the node's API.
pub fn router(state: Arc<AppState>) -> Router {
    routes()
        .router
        .fallback(node_routes::not_found)
        .method_not_allowed_fallback(node_routes::method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), edge::edge))
        .with_state(state)
}

/// The method and path of every route, in the order they are added.
#[cfg(test)]
pub(crate) fn table() -> Vec<(Method, &'static str)> {
    routes().table
}

fn routes() -> Routes {
    Routes::default()
        // The node, and this API's document.
        .get("/healthz", node_routes::healthz)
        .get("/openapi.json", openapi::document)
        .get("/internal/node", node_routes::node_info)
        .post("/internal/templates", sandboxes::build_template)
        .get("/internal/templates", sandboxes::list_templates)
        .post(
            "/internal/sandboxes/{id}/takeover",
            crate::takeover::takeover,
        )
        .post("/internal/sandboxes/{id}/release", moves::release)
        .post("/internal/sandboxes/{id}/forget", moves::forget)
        // One-shot runs.
        .post("/v1/run", run::run)
        // Kept sandboxes.
        .post("/v1/sandboxes", sandboxes::create)
        .get("/v1/sandboxes", sandboxes::list)
        .get("/v1/sandboxes/{id}", sandboxes::get_one)
        .patch("/v1/sandboxes/{id}", sandboxes::patch)
        .delete("/v1/sandboxes/{id}", sandboxes::delete)
        .post("/v1/sandboxes/{id}/restart", sandboxes::restart)
        // Sleep, wake, snapshots and forks.
        .post("/v1/sandboxes/{id}/sleep", checkpoints::sleep)
        .post("/v1/sandboxes/{id}/wake", checkpoints::wake)
        .post("/v1/sandboxes/{id}/snapshots", checkpoints::snapshot)
        .post("/v1/sandboxes/{id}/fork", checkpoints::fork)
        .get("/v1/snapshots", checkpoints::list)
        .get("/v1/snapshots/{id}", checkpoints::get_one)
        .delete("/v1/snapshots/{id}", checkpoints::delete)
        // Volumes.
        .post("/v1/volumes", volumes::create)
        .get("/v1/volumes", volumes::list)
        .get("/v1/volumes/{id}", volumes::get_one)
        .delete("/v1/volumes/{id}", volumes::delete)
        // A sandbox's commands.
        .post("/v1/sandboxes/{id}/exec", sandboxes::exec)
        .get("/v1/sandboxes/{id}/exec", sandboxes::exec_list)
        .post("/v1/sandboxes/{id}/run", sandboxes::run)
        .get("/v1/sandboxes/{id}/exec/{exec_id}", sandboxes::exec_get)
        .get(
            "/v1/sandboxes/{id}/exec/{exec_id}/output",
            sandboxes::output,
        )
        .post("/v1/sandboxes/{id}/exec/{exec_id}/stdin", sandboxes::stdin)
        .post(
            "/v1/sandboxes/{id}/exec/{exec_id}/signal",
            sandboxes::signal,
        )
        .get(
            "/v1/sandboxes/{id}/exec/{exec_id}/terminal",
            terminal::terminal,
        )
        // A sandbox's files.
        .get("/v1/sandboxes/{id}/files", files::download)
        .put("/v1/sandboxes/{id}/files", files::upload)
        .get("/v1/sandboxes/{id}/files/list", files::list)
        .get("/v1/sandboxes/{id}/files/stat", files::stat)
        .post("/v1/sandboxes/{id}/files/mkdir", files::mkdir)
        .post("/v1/sandboxes/{id}/files/rm", files::rm)
        .post("/v1/sandboxes/{id}/files/mv", files::mv)
        .post("/v1/sandboxes/{id}/files/chmod", files::chmod)
        .post("/v1/sandboxes/{id}/files/grep", files::grep)
        .post("/v1/sandboxes/{id}/files/sed", files::sed)
        .get("/v1/sandboxes/{id}/files/tar", files::tar_down)
        .post("/v1/sandboxes/{id}/files/tar", files::tar_up)
        // Images and secrets.
        .get("/v1/images", images::list)
        .post("/v1/images/pull", images::pull)
        .get("/v1/secrets", secrets::list)
        .get("/v1/secrets/{name}", secrets::get_one)
        .put("/v1/secrets/{name}", secrets::put)
        .delete("/v1/secrets/{name}", secrets::delete)
        // The functions interface.
        .post("/v1/functions/{function_id}", function_routes::call)
}

/// The router being built, and the method and path of each route added to it. A path added
/// twice gets both methods (axum merges them); the same method twice panics when built.
#[derive(Default)]
struct Routes {
    router: Router<Arc<AppState>>,
    table: Vec<(Method, &'static str)>,
}

impl Routes {
    fn add<H, T>(mut self, method: Method, filter: MethodFilter, path: &'static str, h: H) -> Self
    where
        H: Handler<T, Arc<AppState>>,
        T: 'static,
    {
        self.router = self.router.route(path, on(filter, h));
        self.table.push((method, path));
        self
    }

    fn get<H: Handler<T, Arc<AppState>>, T: 'static>(self, path: &'static str, h: H) -> Self {
        self.add(Method::GET, MethodFilter::GET, path, h)
    }

    fn post<H: Handler<T, Arc<AppState>>, T: 'static>(self, path: &'static str, h: H) -> Self {
        self.add(Method::POST, MethodFilter::POST, path, h)
    }

    fn put<H: Handler<T, Arc<AppState>>, T: 'static>(self, path: &'static str, h: H) -> Self {
        self.add(Method::PUT, MethodFilter::PUT, path, h)
    }

    fn patch<H: Handler<T, Arc<AppState>>, T: 'static>(self, path: &'static str, h: H) -> Self {
        self.add(Method::PATCH, MethodFilter::PATCH, path, h)
    }

    fn delete<H: Handler<T, Arc<AppState>>, T: 'static>(self, path: &'static str, h: H) -> Self {
        self.add(Method::DELETE, MethodFilter::DELETE, path, h)
    }
}
