//! [`Field`]: a key an object may leave out, give as null or give a value, kept as it came.

use serde::{Deserialize, Serialize};

/// A key an object may leave out, give as null or give a value: kept as it came, so that the
/// object is written back the same. Use with `#[serde(default, skip_serializing_if =
/// "Field::is_absent")]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Field<T> {
    #[default]
    Absent,
    Null,
    Value(T),
}

impl<T> Field<T> {
    /// The value, if there is one.
    pub fn get(&self) -> Option<&T> {
        match self {
            Field::Value(v) => Some(v),
            _ => None,
        }
    }

    pub fn is_absent(&self) -> bool {
        matches!(self, Field::Absent)
    }

    /// Null where `v` is `None` (a key given as null), else the value.
    pub fn given(v: Option<T>) -> Field<T> {
        match v {
            Some(v) => Field::Value(v),
            None => Field::Null,
        }
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Field<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Field<T>, D::Error> {
        Ok(match Option::<T>::deserialize(d)? {
            Some(v) => Field::Value(v),
            None => Field::Null,
        })
    }
}

impl<T: Serialize> Serialize for Field<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Field::Value(v) => v.serialize(s),
            Field::Absent | Field::Null => s.serialize_none(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct T {
        #[serde(default, skip_serializing_if = "Field::is_absent")]
        a: Field<u32>,
    }

    #[test]
    fn absent_null_and_a_value_are_kept() {
        for text in [r#"{}"#, r#"{"a":null}"#, r#"{"a":7}"#] {
            let t: T = serde_json::from_str(text).expect("parses");
            assert_eq!(serde_json::to_string(&t).expect("writes"), text);
        }
        let t: T = serde_json::from_str(r#"{"a":null}"#).expect("parses");
        assert_eq!(t.a, Field::Null);
        assert_eq!(Field::given(Some(3)).get(), Some(&3));
        assert!(Field::<u32>::default().is_absent());
    }
}
