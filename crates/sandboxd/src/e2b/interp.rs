//! The code interpreter of `e2b-code-interpreter` (template `code-interpreter-v1`).
//! (Being written: the server and its start.)

pub const TEMPLATE: &str = "code-interpreter-v1";

pub fn start_command() -> Vec<String> {
    vec![
        "python3".into(),
        "-m".into(),
        "http.server".into(),
        "49999".into(),
    ]
}

pub fn start_env() -> Vec<(String, String)> {
    Vec::new()
}

pub fn ready_check() -> &'static str {
    "http:49999/"
}
