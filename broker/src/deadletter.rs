//! Dead-lettering: the message a queue hands to its dead-letter exchange, with the `x-death`
//! history RabbitMQ writes, and its cycle rule.

use super::queue::DropReason;
use super::Message;
use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use bytes::Bytes;
use std::collections::BTreeMap;

fn s(v: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(v))
}

fn text(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(x) => Some(String::from_utf8_lossy(x.as_bytes()).into_owned()),
        AMQPValue::ShortString(x) => Some(x.as_str().to_string()),
        _ => None,
    }
}

/// The CC header's routing keys (longstr elements only, as RabbitMQ).
pub fn header_keys(headers: Option<&FieldTable>, name: &str) -> Vec<String> {
    match headers.and_then(|h| h.inner().get(name)) {
        Some(AMQPValue::FieldArray(a)) => a
            .as_slice()
            .iter()
            .filter_map(|v| match v {
                AMQPValue::LongString(x) => {
                    Some(String::from_utf8_lossy(x.as_bytes()).into_owned())
                }
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// Copy of `p` with other headers and no expiration (AMQPProperties has no way to unset one
/// field, so every other field is carried over).
pub fn rebuild(
    p: &AMQPProperties,
    headers: Option<FieldTable>,
    keep_expiration: bool,
) -> AMQPProperties {
    let mut out = AMQPProperties::default();
    if let Some(v) = p.content_type() {
        out = out.with_content_type(v.clone());
    }
    if let Some(v) = p.content_encoding() {
        out = out.with_content_encoding(v.clone());
    }
    if let Some(h) = headers {
        out = out.with_headers(h);
    }
    if let Some(v) = p.delivery_mode() {
        out = out.with_delivery_mode(*v);
    }
    if let Some(v) = p.priority() {
        out = out.with_priority(*v);
    }
    if let Some(v) = p.correlation_id() {
        out = out.with_correlation_id(v.clone());
    }
    if let Some(v) = p.reply_to() {
        out = out.with_reply_to(v.clone());
    }
    if keep_expiration {
        if let Some(v) = p.expiration() {
            out = out.with_expiration(v.clone());
        }
    }
    if let Some(v) = p.message_id() {
        out = out.with_message_id(v.clone());
    }
    if let Some(v) = p.timestamp() {
        out = out.with_timestamp(*v);
    }
    if let Some(v) = p.kind() {
        out = out.with_type(v.clone());
    }
    if let Some(v) = p.user_id() {
        out = out.with_user_id(v.clone());
    }
    if let Some(v) = p.app_id() {
        out = out.with_app_id(v.clone());
    }
    if let Some(v) = p.cluster_id() {
        out = out.with_cluster_id(v.clone());
    }
    out
}

/// The properties of `msg` dead-lettered from `queue` for `reason` at `now_secs`: `x-death`
/// updated as RabbitMQ does (same queue and reason: count + 1 and moved first; else a new entry
/// first), `x-first-death-*` set on a first death, `expiration` removed (kept as
/// `original-expiration` in the entry), `CC` removed when `drop_cc` (a dead-letter routing key
/// replaces the original keys).
///
/// Returns the properties and their encoding. A first death's entry is encoded in RabbitMQ's
/// field order (count, reason, queue, time, exchange, routing-keys, original-expiration), which
/// a `FieldTable` (a sorted map) cannot keep; later entries are sorted, as RabbitMQ sorts them.
pub fn dead_letter_properties(
    msg: &Message,
    reason: DropReason,
    queue: &str,
    now_secs: u64,
    drop_cc: bool,
) -> (AMQPProperties, Bytes) {
    let p = &msg.properties;
    let mut headers: BTreeMap<ShortString, AMQPValue> = p
        .headers()
        .as_ref()
        .map(|h| h.inner().clone())
        .unwrap_or_default();
    let mut routing_keys = vec![s(msg.routing_key.as_ref())];
    routing_keys.extend(header_keys(p.headers().as_ref(), "CC").iter().map(|k| s(k)));
    let mut fields: Vec<(&'static str, AMQPValue)> = vec![
        ("count", AMQPValue::LongLongInt(1)),
        ("reason", s(reason.as_str())),
        ("queue", s(queue)),
        ("time", AMQPValue::Timestamp(now_secs)),
        ("exchange", s(msg.exchange.as_ref())),
        (
            "routing-keys",
            AMQPValue::FieldArray(FieldArray::from(routing_keys)),
        ),
    ];
    if let Some(e) = p.expiration() {
        fields.push(("original-expiration", s(e.as_str())));
    }
    let mut entry = FieldTable::default();
    for (k, v) in &fields {
        entry.insert((*k).into(), v.clone());
    }
    let first_death = !headers.contains_key("x-death");
    // A first-death layout (no x-death yet, or one that is not an array) keeps RabbitMQ's order.
    let ordered_entry = !matches!(headers.get("x-death"), Some(AMQPValue::FieldArray(_)));
    let deaths = match headers.get("x-death") {
        Some(AMQPValue::FieldArray(arr)) => {
            let mut deaths = group_old_deaths(arr.as_slice());
            let same = deaths.iter().position(|d| match d {
                AMQPValue::FieldTable(t) => {
                    t.inner().get("queue").and_then(text).as_deref() == Some(queue)
                        && t.inner().get("reason").and_then(text).as_deref()
                            == Some(reason.as_str())
                }
                _ => false,
            });
            match same {
                Some(i) => {
                    let mut t = match deaths.remove(i) {
                        AMQPValue::FieldTable(t) => t.inner().clone(),
                        _ => BTreeMap::new(),
                    };
                    let count = match t.get("count") {
                        // Whatever the client wrote there: a count past i64 (or one near
                        // it) stays at i64::MAX rather than wrapping (or, in a debug build,
                        // panicking with the message already out of its queue).
                        Some(v) => i64::try_from(super::args::int_value(v).unwrap_or(0))
                            .unwrap_or(i64::MAX)
                            .saturating_add(1),
                        None => 1,
                    };
                    t.insert("count".into(), AMQPValue::LongLongInt(count));
                    deaths.insert(0, AMQPValue::FieldTable(FieldTable::from(t)));
                }
                None => deaths.insert(0, AMQPValue::FieldTable(entry)),
            }
            deaths
        }
        _ => vec![AMQPValue::FieldTable(entry)],
    };
    headers.insert(
        "x-death".into(),
        AMQPValue::FieldArray(FieldArray::from(deaths)),
    );
    if first_death {
        for (k, v) in [
            ("x-first-death-exchange", msg.exchange.as_ref()),
            ("x-first-death-queue", queue),
            ("x-first-death-reason", reason.as_str()),
        ] {
            headers.entry(k.into()).or_insert_with(|| s(v));
        }
    }
    // RabbitMQ 3.13's x-last-death-* name the newest death (3.10 has none; clients written for
    // newer brokers read them).
    for (k, v) in [
        ("x-last-death-exchange", msg.exchange.as_ref()),
        ("x-last-death-queue", queue),
        ("x-last-death-reason", reason.as_str()),
    ] {
        headers.insert(k.into(), s(v));
    }
    if drop_cc {
        headers.remove("CC");
    }
    let raw = if ordered_entry {
        encode_with_headers(&rebuild(p, None, false), &headers, &fields)
    } else {
        None
    };
    let props = rebuild(p, Some(FieldTable::from(headers)), false);
    let raw = raw.unwrap_or_else(|| warren_protocol::codec::encode_properties(&props));
    (props, raw)
}

/// The entries of an `x-death` array with entries for the same queue and reason merged, as
/// RabbitMQ does for headers written before 3.8 (one entry per death, without `count`): the
/// first entry of each (queue, reason) stands for the group, in the order the groups first
/// appear, and gets as `count` the size of its group when it has none. A single entry is kept
/// as it is.
fn group_old_deaths(arr: &[AMQPValue]) -> Vec<AMQPValue> {
    if arr.len() < 2 {
        return arr.to_vec();
    }
    let key = |v: &AMQPValue| match v {
        AMQPValue::FieldTable(t) => Some((
            t.inner().get("queue").and_then(text),
            t.inner().get("reason").and_then(text),
        )),
        _ => None,
    };
    let keys: Vec<_> = arr.iter().map(key).collect();
    // Each group's size, then each group's first entry: counted in one pass each (the
    // header is the client's, with thousands of entries if it likes; comparing each entry
    // with every other one was quadratic, under the broker lock).
    let mut sizes: std::collections::HashMap<&_, usize> = std::collections::HashMap::new();
    for k in keys.iter().flatten() {
        *sizes.entry(k).or_default() += 1;
    }
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(arr.len());
    for (i, v) in arr.iter().enumerate() {
        let (AMQPValue::FieldTable(t), Some(k)) = (v, &keys[i]) else {
            out.push(v.clone());
            continue;
        };
        if !seen.insert(k) {
            continue;
        }
        if t.inner().contains_key("count") {
            out.push(v.clone());
        } else {
            let n = sizes.get(k).copied().unwrap_or(1);
            let mut t = t.inner().clone();
            t.insert("count".into(), AMQPValue::LongLongInt(n as i64));
            out.push(AMQPValue::FieldTable(FieldTable::from(t)));
        }
    }
    out
}

fn value_bytes(v: &AMQPValue) -> Option<Vec<u8>> {
    use amq_protocol::frame::WriteContext;
    amq_protocol::types::generation::gen_value(v)(WriteContext::from(Vec::new()))
        .ok()
        .map(|c| c.into_inner().0)
}

fn put_key(out: &mut Vec<u8>, k: &str) {
    out.push(k.len() as u8);
    out.extend_from_slice(k.as_bytes());
}

/// Encode `base` (which has no headers) with `headers` spliced in, the `x-death` array holding
/// one entry with `fields` in the given order.
fn encode_with_headers(
    base: &AMQPProperties,
    headers: &BTreeMap<ShortString, AMQPValue>,
    fields: &[(&'static str, AMQPValue)],
) -> Option<Bytes> {
    let mut table = Vec::new();
    for (k, v) in headers {
        put_key(&mut table, k.as_str());
        if k.as_str() == "x-death" {
            let mut entry = Vec::new();
            for (fk, fv) in fields {
                put_key(&mut entry, fk);
                entry.extend_from_slice(&value_bytes(fv)?);
            }
            let mut array = vec![b'F'];
            array.extend_from_slice(&(entry.len() as u32).to_be_bytes());
            array.extend_from_slice(&entry);
            table.push(b'A');
            table.extend_from_slice(&(array.len() as u32).to_be_bytes());
            table.extend_from_slice(&array);
        } else {
            table.extend_from_slice(&value_bytes(v)?);
        }
    }
    let encoded = warren_protocol::codec::encode_properties(base);
    if encoded.len() < 2 {
        return None;
    }
    // Property list order: content-type, content-encoding, then headers (flag bit 13).
    let mut flags = u16::from_be_bytes([encoded[0], encoded[1]]);
    let mut at = 2usize;
    for bit in [0x8000u16, 0x4000] {
        if flags & bit != 0 {
            at += 1 + *encoded.get(at)? as usize;
        }
    }
    flags |= 0x2000;
    let mut out = Vec::with_capacity(encoded.len() + table.len() + 4);
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(encoded.get(2..at)?);
    out.extend_from_slice(&(table.len() as u32).to_be_bytes());
    out.extend_from_slice(&table);
    out.extend_from_slice(encoded.get(at..)?);
    Some(Bytes::from(out))
}

/// RabbitMQ's cycle rule: for a reason other than `rejected`, a target queue that appears in
/// the message's `x-death` with no `rejected` death from the newest entry up to that queue's
/// newest entry is skipped (the message would loop forever).
pub fn is_cycle(props: &AMQPProperties, reason: DropReason, target: &str) -> bool {
    if reason == DropReason::Rejected {
        return false;
    }
    let Some(AMQPValue::FieldArray(deaths)) = props
        .headers()
        .as_ref()
        .and_then(|h| h.inner().get("x-death"))
    else {
        return false;
    };
    for d in deaths.as_slice() {
        let AMQPValue::FieldTable(t) = d else {
            continue;
        };
        if t.inner().get("reason").and_then(text).as_deref() == Some("rejected") {
            return false;
        }
        if t.inner().get("queue").and_then(text).as_deref() == Some(target) {
            return true;
        }
    }
    false
}
