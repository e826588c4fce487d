//! A function's payload: its fields by name, read with the interface's checks (S001).

use std::collections::BTreeMap;

use sbx_api::functions::FnError;
use serde_json::{Map, Value};

pub(super) struct Payload(pub(super) Map<String, Value>);

impl Payload {
    pub(super) fn known(&self, keys: &[&str]) -> Result<(), FnError> {
        match self.0.keys().find(|k| !keys.contains(&k.as_str())) {
            Some(k) => Err(FnError::invalid(format!(
                "this function takes no field {k}"
            ))),
            None => Ok(()),
        }
    }

    pub(super) fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    pub(super) fn str(&self, k: &str) -> Result<Option<String>, FnError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(Value::Number(n)) => Ok(Some(n.to_string())),
            Some(Value::Bool(b)) => Ok(Some(b.to_string())),
            Some(_) => Err(FnError::invalid(format!("{k} must be a string"))),
        }
    }

    pub(super) fn req_str(&self, k: &str) -> Result<String, FnError> {
        match self.str(k)? {
            Some(s) if !s.is_empty() => Ok(s),
            _ => Err(FnError::invalid(format!("{k} is required"))),
        }
    }

    pub(super) fn u64(&self, k: &str) -> Result<Option<u64>, FnError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64()),
            Some(Value::String(s)) if s.trim().parse::<u64>().is_ok() => {
                Ok(s.trim().parse::<u64>().ok())
            }
            Some(_) => Err(FnError::invalid(format!("{k} must be a whole number"))),
        }
    }

    pub(super) fn bool(&self, k: &str) -> Result<Option<bool>, FnError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(Value::String(s)) if s == "true" || s == "false" => Ok(Some(s == "true")),
            Some(_) => Err(FnError::invalid(format!("{k} must be true or false"))),
        }
    }

    pub(super) fn str_list(&self, k: &str) -> Result<Option<Vec<String>>, FnError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    Value::Number(n) => Ok(n.to_string()),
                    _ => Err(FnError::invalid(format!("{k} must be a list of strings"))),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(_) => Err(FnError::invalid(format!("{k} must be a list of strings"))),
        }
    }

    /// `env`: an object of strings, or a list of `K=V` (a single `K=V` string too).
    pub(super) fn env(&self) -> Result<Option<BTreeMap<String, String>>, FnError> {
        let bad = || FnError::invalid("env must be an object or a list of K=V");
        let pair = |s: &str| -> Result<(String, String), FnError> {
            s.split_once('=')
                .filter(|(k, _)| !k.is_empty())
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or_else(bad)
        };
        match self.get("env") {
            None => Ok(None),
            Some(Value::Object(m)) => m
                .iter()
                .map(|(k, v)| match v {
                    Value::String(s) => Ok((k.clone(), s.clone())),
                    Value::Number(_) | Value::Bool(_) => Ok((k.clone(), v.to_string())),
                    _ => Err(bad()),
                })
                .collect::<Result<_, _>>()
                .map(Some),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().ok_or_else(bad).and_then(pair))
                .collect::<Result<_, _>>()
                .map(Some),
            Some(Value::String(s)) => Ok(Some([pair(s)?].into_iter().collect())),
            Some(_) => Err(bad()),
        }
    }
}
