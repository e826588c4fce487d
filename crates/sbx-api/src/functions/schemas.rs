//! The `sandbox::*` functions' ids, one-line descriptions and request/response JSON schemas:
//! pure data, shared by the node's iii worker (`sbx-functions`) and the control plane's
//! (`sbx-control`), which register the same functions (the node in its own namespace in a
//! fleet, the control plane in the engine's default one).

use serde_json::{json, Value};

/// Every function served.
pub const FUNCTIONS: [&str; 17] = [
    "sandbox::run",
    "sandbox::create",
    "sandbox::exec",
    "sandbox::list",
    "sandbox::stop",
    "sandbox::catalog::list",
    "sandbox::fs::mkdir",
    "sandbox::fs::write",
    "sandbox::fs::ls",
    "sandbox::fs::stat",
    "sandbox::fs::read",
    "sandbox::fs::chmod",
    "sandbox::fs::grep",
    "sandbox::fs::sed",
    "sandbox::fs::mv",
    "sandbox::fs::rm",
    "sandbox::adapter::info",
];

/// A function's one-line description (what the engine lists).
pub fn describe(id: &str) -> &'static str {
    match id {
        "sandbox::run" => "Run a snippet in a new sandbox and return its output",
        "sandbox::create" => "Create a sandbox; returns its sandbox_id",
        "sandbox::exec" => "Run a command in a sandbox and wait for its end",
        "sandbox::list" => "The sandboxes made through the functions",
        "sandbox::stop" => "Stop a sandbox",
        "sandbox::catalog::list" => "The images a sandbox can boot",
        "sandbox::adapter::info" => "This adapter: name, version, contract, limits",
        "sandbox::fs::mkdir" => "Make a directory in a sandbox",
        "sandbox::fs::write" => "Write a file in a sandbox",
        "sandbox::fs::ls" => "List a directory of a sandbox",
        "sandbox::fs::stat" => "A file's metadata",
        "sandbox::fs::read" => "Read a file of a sandbox (inline under 1 MiB)",
        "sandbox::fs::chmod" => "Change a file's mode or owner",
        "sandbox::fs::grep" => "Search files of a sandbox",
        "sandbox::fs::sed" => "Replace in files of a sandbox",
        "sandbox::fs::mv" => "Move or rename a file",
        "sandbox::fs::rm" => "Remove a file or directory",
        _ => "sandbox function",
    }
}

// ---- schemas (JSON Schema, hand-written from functions.rs: its `known` keys and replies) ----

/// An object of these properties, the `required` ones required, and no others but the fields
/// an engine adds (names starting with `_`, e.g. `_caller_worker_id`), which the node ignores.
fn req(props: Value, required: &[&str]) -> Value {
    json!({
        "type": "object",
        "properties": props,
        "required": required,
        "patternProperties": { "^_": {} },
        "additionalProperties": false,
    })
}

/// A reply: an object with at least these properties.
fn reply(props: Value, required: &[&str]) -> Value {
    json!({ "type": "object", "properties": props, "required": required })
}

/// A sandbox::fs::* request: `sandbox_id` and `props`.
fn fs_req(mut props: Value, required: &[&str]) -> Value {
    props["sandbox_id"] = json!({ "type": "string" });
    let mut r = vec!["sandbox_id"];
    r.extend_from_slice(required);
    req(props, &r)
}

fn string() -> Value {
    json!({ "type": "string" })
}
fn boolean() -> Value {
    json!({ "type": "boolean" })
}
fn uint() -> Value {
    json!({ "type": "integer", "minimum": 0 })
}
fn strings() -> Value {
    json!({ "type": "array", "items": { "type": "string" } })
}
/// `env`: an object of strings, or a list of `K=V` (one `K=V` string too).
fn env() -> Value {
    json!({
        "type": ["object", "array", "string"],
        "additionalProperties": { "type": ["string", "number", "boolean"] },
        "items": { "type": "string" },
    })
}
fn mode() -> Value {
    json!({ "type": ["string", "integer"] })
}

// What a request's fields take: functions.rs reads a number or a boolean as a string, and
// "true"/"false" and digits as a boolean and a number (callers of key=value CLIs send text).
fn text() -> Value {
    json!({ "type": ["string", "number", "boolean"] })
}
fn flag() -> Value {
    json!({ "type": ["boolean", "string"], "enum": [true, false, "true", "false"] })
}
fn count() -> Value {
    json!({ "type": ["integer", "string"], "minimum": 0, "pattern": "^\\s*[0-9]+\\s*$" })
}
fn texts() -> Value {
    json!({ "type": "array", "items": { "type": ["string", "number"] } })
}
fn globs() -> Value {
    json!({ "type": ["string", "array"], "items": { "type": "string" } })
}

/// The reply of `run` and `exec`.
fn output() -> Value {
    reply(
        json!({
            "stdout": string(),
            "stderr": string(),
            "exit_code": { "type": "integer" },
            "timed_out": boolean(),
            "duration_ms": uint(),
            "success": boolean(),
            "stdout_truncated": boolean(),
            "stderr_truncated": boolean(),
            "sandbox_id": string(),
        }),
        &[
            "stdout",
            "stderr",
            "exit_code",
            "timed_out",
            "duration_ms",
            "success",
        ],
    )
}

/// A file's entry (sbx-api's `files::FileObject`), plus what an operation adds.
fn entry() -> Value {
    reply(
        json!({
            "object": string(),
            "name": string(),
            "path": string(),
            "type": string(),
            "size": uint(),
            "mode": string(),
            "uid": uint(),
            "gid": uint(),
            "modified_at": string(),
            "target": { "type": ["string", "null"] },
        }),
        &["path", "type"],
    )
}

/// (request, response) schemas of a function.
pub fn schemas(id: &str) -> (Value, Value) {
    match id {
        "sandbox::run" => (
            req(
                json!({
                    "image": text(),
                    "lang": { "type": "string", "description": "node, python, shell or an interpreter path" },
                    "code": text(),
                    "files": {
                        "type": ["array", "object"],
                        "items": reply(json!({ "path": text(), "content": text(), "content_b64": text() }), &["path"]),
                    },
                    "env": env(),
                    "stdin": text(),
                    "timeout_ms": count(),
                    "keep_sandbox": flag(),
                }),
                &["image", "lang", "code"],
            ),
            output(),
        ),
        "sandbox::create" => (
            req(
                json!({
                    "image": text(),
                    "cpus": count(),
                    "memory_mb": count(),
                    "name": text(),
                    "network": flag(),
                    "idle_timeout_secs": count(),
                    "env": env(),
                }),
                &["image"],
            ),
            reply(
                json!({ "sandbox_id": string(), "image": string() }),
                &["sandbox_id", "image"],
            ),
        ),
        "sandbox::exec" => (
            req(
                json!({
                    "sandbox_id": text(),
                    "cmd": text(),
                    "args": texts(),
                    "argv": texts(),
                    "stdin": text(),
                    "env": env(),
                    "timeout_ms": count(),
                    "workdir": text(),
                }),
                &["sandbox_id"],
            ),
            output(),
        ),
        "sandbox::list" => (
            req(json!({}), &[]),
            reply(
                json!({ "sandboxes": { "type": "array", "items": reply(json!({
                    "sandbox_id": string(),
                    "name": { "type": ["string", "null"] },
                    "image": string(),
                    "age_secs": uint(),
                    "exec_in_progress": boolean(),
                    "exec_in_flight": uint(),
                    "exec_slots_free": uint(),
                    "stopped": boolean(),
                    "status": string(),
                }), &["sandbox_id"]) } }),
                &["sandboxes"],
            ),
        ),
        "sandbox::stop" => (
            req(
                json!({ "sandbox_id": text(), "wait": flag() }),
                &["sandbox_id"],
            ),
            reply(
                json!({ "sandbox_id": string(), "stopped": boolean() }),
                &["sandbox_id", "stopped"],
            ),
        ),
        "sandbox::catalog::list" => (
            req(json!({}), &[]),
            reply(
                json!({ "images": { "type": "array", "items": reply(
                    json!({ "name": string(), "oci_ref": string(), "kind": string() }),
                    &["name"],
                ) } }),
                &["images"],
            ),
        ),
        "sandbox::adapter::info" => (
            req(json!({}), &[]),
            reply(
                json!({
                    "contract": string(),
                    "info": reply(json!({
                        "name": string(),
                        "version": string(),
                        "contract": string(),
                        "driver": string(),
                        "functions": strings(),
                        "max_concurrent_exec_per_sandbox": uint(),
                        "max_exec_timeout_ms": uint(),
                        "max_sandboxes": uint(),
                    }), &["name", "contract"]),
                }),
                &["contract", "info"],
            ),
        ),
        "sandbox::fs::mkdir" => (
            fs_req(
                json!({ "path": text(), "parents": flag(), "mode": mode(), "owner": text() }),
                &["path"],
            ),
            entry(),
        ),
        "sandbox::fs::write" => (
            fs_req(
                json!({
                    "path": text(),
                    "content": text(),
                    "content_b64": text(),
                    "mode": mode(),
                    "parents": flag(),
                    "owner": text(),
                }),
                &["path"],
            ),
            entry(),
        ),
        "sandbox::fs::ls" => (
            fs_req(json!({ "path": text(), "limit": count() }), &["path"]),
            reply(
                json!({
                    "path": string(),
                    "entries": { "type": "array", "items": entry() },
                    "truncated": boolean(),
                }),
                &["entries"],
            ),
        ),
        "sandbox::fs::stat" => (fs_req(json!({ "path": text() }), &["path"]), entry()),
        "sandbox::fs::read" => (
            fs_req(json!({ "path": text() }), &["path"]),
            reply(
                json!({
                    "path": string(),
                    "size": uint(),
                    "body": string(),
                    "content_b64": string(),
                    "content": reply(json!({ "method": string(), "url": string() }), &["url"]),
                }),
                &["path", "size"],
            ),
        ),
        "sandbox::fs::chmod" => (
            fs_req(
                json!({
                    "path": text(),
                    "mode": mode(),
                    "uid": count(),
                    "gid": count(),
                    "recursive": flag(),
                }),
                &["path"],
            ),
            reply(json!({ "path": string(), "changed": uint() }), &["changed"]),
        ),
        "sandbox::fs::grep" => (
            fs_req(
                json!({
                    "path": text(),
                    "pattern": text(),
                    "literal": flag(),
                    "recursive": flag(),
                    "ignore_case": flag(),
                    "include": globs(),
                    "exclude": globs(),
                    "max_matches": count(),
                    "max_line_bytes": count(),
                }),
                &["path", "pattern"],
            ),
            reply(
                json!({
                    "matches": { "type": "array", "items": { "type": "object" } },
                    "truncated": boolean(),
                    "files_scanned": uint(),
                }),
                &["matches"],
            ),
        ),
        "sandbox::fs::sed" => (
            fs_req(
                json!({
                    "path": text(),
                    "pattern": text(),
                    "replacement": text(),
                    "literal": flag(),
                    "first_only": flag(),
                    "ignore_case": flag(),
                    "recursive": flag(),
                    "include": globs(),
                    "exclude": globs(),
                }),
                &["path", "pattern", "replacement"],
            ),
            reply(
                json!({
                    "files_changed": uint(),
                    "files": { "type": "array" },
                    "replacements": uint(),
                    "files_scanned": uint(),
                    "truncated": boolean(),
                }),
                &["files_changed"],
            ),
        ),
        "sandbox::fs::mv" => (
            fs_req(
                json!({ "src": text(), "dst": text(), "overwrite": flag() }),
                &["src", "dst"],
            ),
            entry(),
        ),
        "sandbox::fs::rm" => (
            fs_req(json!({ "path": text(), "recursive": flag() }), &["path"]),
            entry(),
        ),
        _ => (json!({ "type": "object" }), json!({ "type": "object" })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every function has its own schemas, and they say what the functions take.
    #[test]
    fn every_function_has_schemas() {
        for id in FUNCTIONS {
            let (rq, rs) = schemas(id);
            assert_eq!(rq["type"], "object", "{id}");
            assert_eq!(rq["additionalProperties"], false, "{id}");
            assert!(rs["properties"].is_object(), "{id}: {rs}");
            if id.starts_with("sandbox::fs::") {
                assert!(rq["required"]
                    .as_array()
                    .is_some_and(|r| r.contains(&json!("sandbox_id"))));
            }
            assert_ne!(describe(id), "sandbox function", "{id}");
        }
    }
}
