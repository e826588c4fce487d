//! `sbx egress SANDBOX --allow pypi.org --deny '*'`: a sandbox's egress rules changed live
//! (`PATCH /v1/sandboxes/{id}` with the keys given; the others are kept).

use serde_json::{json, Map, Value};

use crate::sandboxes::req;
use crate::{api_error, Cli};

#[derive(clap::Args, Debug)]
pub struct EgressArgs {
    /// The sandbox (id or name).
    sandbox: String,
    /// What holds where no rule speaks: allow or deny.
    #[arg(long, value_parser = ["allow", "deny"])]
    default: Option<String>,
    /// Allowed: an IP, a CIDR, a DNS name, *.name or * (repeatable; replaces `allow`).
    #[arg(long)]
    allow: Vec<String>,
    /// Refused, as --allow (repeatable; replaces `deny`).
    #[arg(long)]
    deny: Vec<String>,
    /// A port refused, TCP and UDP, whatever else holds (repeatable; replaces `deny_ports`).
    #[arg(long = "deny-port")]
    deny_ports: Vec<u16>,
    /// Remove every rule of the sandbox first.
    #[arg(long)]
    clear: bool,
    /// Print the sandbox object as JSON.
    #[arg(long)]
    json: bool,
}

/// The PATCH body of `a`.
fn body(a: &EgressArgs) -> Value {
    let mut e = Map::new();
    if a.clear {
        for k in ["default", "allow", "deny", "http", "inject", "deny_ports"] {
            e.insert(k.into(), Value::Null);
        }
    }
    if let Some(d) = &a.default {
        e.insert("default".into(), json!(d));
    }
    if !a.allow.is_empty() {
        e.insert("allow".into(), json!(a.allow));
    }
    if !a.deny.is_empty() {
        e.insert("deny".into(), json!(a.deny));
    }
    if !a.deny_ports.is_empty() {
        e.insert("deny_ports".into(), json!(a.deny_ports));
    }
    json!({ "egress": e })
}

pub fn egress(cli: &Cli, a: &EgressArgs) -> anyhow::Result<u8> {
    let obj: Value = req(cli, "PATCH", &format!("/v1/sandboxes/{}", a.sandbox))
        .send_json(body(a))
        .map_err(api_error)?
        .into_json()?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&obj)?);
    } else {
        println!("{}", serde_json::to_string(&obj["egress"])?);
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: EgressArgs,
    }

    #[test]
    fn flags_make_the_patch() {
        let t = T::parse_from([
            "t",
            "dev",
            "--allow",
            "pypi.org",
            "--deny",
            "*",
            "--deny-port",
            "25",
        ]);
        assert_eq!(
            body(&t.a),
            json!({"egress": {"allow": ["pypi.org"], "deny": ["*"], "deny_ports": [25]}})
        );
        let t = T::parse_from(["t", "dev", "--clear", "--default", "deny"]);
        assert_eq!(body(&t.a)["egress"]["default"], "deny");
        assert_eq!(body(&t.a)["egress"]["allow"], Value::Null);
    }
}
