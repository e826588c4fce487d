//! The code interpreter of `e2b-code-interpreter` (template `code-interpreter-v1`).
