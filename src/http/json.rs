//! JSON in and out: request bodies (objects, flags, `arguments`) and field tables as
//! RabbitMQ's API renders them.

use amq_protocol::types::{AMQPValue, FieldTable};
use serde_json::{json, Map, Value};

/// The JSON body of a PUT: an object (an empty body is an empty object).
pub(super) fn body_object(body: &axum::body::Bytes) -> Result<Map<String, Value>, String> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err("not a JSON object".into()),
        Err(_) => Err("not_json".into()),
    }
}

pub(super) fn flag(m: &Map<String, Value>, key: &str, default: bool) -> Result<bool, String> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(Value::String(s)) if s == "true" || s == "false" => Ok(s == "true"),
        Some(_) => Err(format!("{key} must be true or false")),
    }
}

pub(super) fn arguments(m: &Map<String, Value>) -> Result<FieldTable, String> {
    match m.get("arguments") {
        None | Some(Value::Null) => Ok(FieldTable::default()),
        Some(Value::Object(a)) => Ok(json_table(a)),
        Some(_) => Err("arguments must be an object".into()),
    }
}

/// A JSON object as a field table: integers as signed 64-bit, other numbers as doubles.
///
/// A field table's keys are short strings (255 bytes at most). RabbitMQ accepts a longer
/// argument key through its HTTP API (201) and keeps it; no argument Warren knows is that
/// long, so such a key is accepted and left out, with a warning (a README deviation).
pub(super) fn json_table(m: &Map<String, Value>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in m {
        match amq_protocol::types::ShortString::try_new(k.as_str()) {
            Ok(key) => {
                t.insert(key, json_value(v));
            }
            Err(_) => tracing::warn!(
                bytes = k.len(),
                "an argument key longer than 255 bytes is ignored"
            ),
        }
    }
    t
}

fn json_value(v: &Value) -> AMQPValue {
    match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().unwrap_or(0.0)),
        },
        Value::String(s) => AMQPValue::LongString(s.as_str().into()),
        Value::Array(a) => {
            AMQPValue::FieldArray(a.iter().map(json_value).collect::<Vec<_>>().into())
        }
        Value::Object(o) => AMQPValue::FieldTable(json_table(o)),
    }
}

/// A field table as RabbitMQ's API renders it: a JSON object of plain values.
pub(super) fn table_json(t: &FieldTable) -> Map<String, Value> {
    t.inner()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), value_json(v)))
        .collect()
}

fn value_json(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => json!(b),
        AMQPValue::ShortShortInt(i) => json!(i),
        AMQPValue::ShortShortUInt(i) => json!(i),
        AMQPValue::ShortInt(i) => json!(i),
        AMQPValue::ShortUInt(i) => json!(i),
        AMQPValue::LongInt(i) => json!(i),
        AMQPValue::LongUInt(i) => json!(i),
        AMQPValue::LongLongInt(i) => json!(i),
        AMQPValue::Float(f) => json!(f),
        AMQPValue::Double(f) => json!(f),
        AMQPValue::DecimalValue(d) => json!(d.value as f64 / 10f64.powi(d.scale as i32)),
        AMQPValue::ShortString(s) => json!(s.as_str()),
        AMQPValue::LongString(s) => json!(String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::ByteArray(b) => json!(String::from_utf8_lossy(b.as_slice())),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(value_json).collect()),
        AMQPValue::Timestamp(t) => json!(t),
        AMQPValue::FieldTable(t) => Value::Object(table_json(t)),
        // RabbitMQ writes void as "undefined" (its Erlang atom); its definitions import
        // refuses a JSON null ("null_not_allowed"), so an export with one would not import.
        AMQPValue::Void => Value::String("undefined".into()),
    }
}
