//! `sbx call FUNCTION key=value…`: calls a function of the node's functions interface
//! (`POST /v1/functions/{function_id}`) and prints its reply as JSON.
//!
//! A `key=value` argument's value is JSON where it parses as JSON (`timeout_ms=500`,
//! `parents=true`, `env='{"A":"1"}'`), a string otherwise (`cmd='python3 --version'`,
//! `mode=0644`). `--json '{…}'` gives a whole payload (nested ones); key=value arguments are
//! set over it. A failed call prints `{"error":{code,type,message,retryable,docs_url}}` and
//! exits 1.

use anyhow::{anyhow, bail, Context};
use serde_json::{Map, Value};

use crate::Cli;

#[derive(clap::Args, Debug)]
pub(crate) struct CallArgs {
    /// The function (sandbox::run, sandbox::create, sandbox::fs::read, ...).
    function_id: String,
    /// The payload as a JSON object (key=value arguments are set over it).
    #[arg(long)]
    json: Option<String>,
    /// Fields of the payload, key=value (the value is JSON where it parses, else a string).
    #[arg(value_name = "KEY=VALUE")]
    fields: Vec<String>,
}

/// The payload of `--json` and the key=value arguments.
pub(crate) fn payload(json: Option<&str>, fields: &[String]) -> anyhow::Result<Value> {
    let mut obj = match json {
        None => Map::new(),
        Some(text) => match serde_json::from_str::<Value>(text).context("--json")? {
            Value::Object(m) => m,
            _ => bail!("--json must be a JSON object"),
        },
    };
    for f in fields {
        let (k, v) = f
            .split_once('=')
            .ok_or_else(|| anyhow!("arguments are key=value, got {f:?}"))?;
        if k.is_empty() {
            bail!("arguments are key=value, got {f:?}");
        }
        let value = serde_json::from_str::<Value>(v).unwrap_or_else(|_| Value::String(v.into()));
        obj.insert(k.to_string(), value);
    }
    Ok(Value::Object(obj))
}

pub(crate) fn call(cli: &Cli, a: &CallArgs) -> anyhow::Result<u8> {
    let body = payload(a.json.as_deref(), &a.fields)?;
    crate::ensure_node(cli)?;
    match cli.client().call_function(&a.function_id, &body) {
        Ok(v) => {
            println!("{}", serde_json::to_string_pretty(&v)?);
            Ok(0)
        }
        Err(sbx_client::Error::Node(e)) => {
            println!("{}", serde_json::to_string_pretty(&e.body)?);
            eprintln!("sbx: {}: {}", e.code, e.message);
            Ok(1)
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_json_where_they_parse() {
        let p = payload(
            Some(r#"{"env":{"A":"1"},"image":"node"}"#),
            &[
                "image=python".into(),
                "code=print(2+2)".into(),
                "timeout_ms=500".into(),
                "keep_sandbox=true".into(),
                "mode=0644".into(),
                "cmd=python3 --version".into(),
                "x=a=b".into(),
            ],
        )
        .unwrap();
        assert_eq!(p["image"], "python");
        assert_eq!(p["env"]["A"], "1");
        assert_eq!(p["code"], "print(2+2)");
        assert_eq!(p["timeout_ms"], 500);
        assert_eq!(p["keep_sandbox"], true);
        assert_eq!(p["mode"], "0644");
        assert_eq!(p["cmd"], "python3 --version");
        assert_eq!(p["x"], "a=b");
        assert!(payload(None, &["novalue".into()]).is_err());
        assert!(payload(Some("[1]"), &[]).is_err());
    }
}
