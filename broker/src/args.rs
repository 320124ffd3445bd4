//! Queue arguments: validation at declare and equivalence on redeclare, with RabbitMQ's
//! reply texts.

use super::type_name;
use amq_protocol::types::{AMQPValue, FieldTable};
use warren_protocol::AmqpError;

/// Queue arguments RabbitMQ compares on redeclare; others are stored but not compared.
const COMPARED: &[&str] = &[
    "x-expires",
    "x-message-ttl",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-length",
    "x-max-length-bytes",
    "x-max-in-memory-length",
    "x-max-in-memory-bytes",
    "x-max-priority",
    "x-overflow",
    "x-queue-mode",
    "x-queue-type",
    "x-single-active-consumer",
    "x-delivery-limit",
    "x-queue-master-locator",
    "x-queue-leader-locator",
];

/// An integer argument's value, whatever its wire width.
pub fn int_value(v: &AMQPValue) -> Option<i128> {
    Some(match v {
        AMQPValue::ShortShortInt(x) => *x as i128,
        AMQPValue::ShortShortUInt(x) => *x as i128,
        AMQPValue::ShortInt(x) => *x as i128,
        AMQPValue::ShortUInt(x) => *x as i128,
        AMQPValue::LongInt(x) => *x as i128,
        AMQPValue::LongUInt(x) => *x as i128,
        AMQPValue::LongLongInt(x) => *x as i128,
        _ => return None,
    })
}

fn string_value(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        _ => None,
    }
}

/// How a value reads in RabbitMQ's messages: `'1000'` for the value alone.
fn plain(v: &AMQPValue) -> String {
    match (int_value(v), string_value(v)) {
        (Some(i), _) => i.to_string(),
        (_, Some(s)) => s,
        _ => match v {
            AMQPValue::Boolean(b) => b.to_string(),
            other => format!("{other:?}"),
        },
    }
}

fn typed(v: &AMQPValue) -> String {
    format!("the value '{}' of type '{}'", plain(v), type_name(v))
}

fn equivalent(a: &AMQPValue, b: &AMQPValue) -> bool {
    match (int_value(a), int_value(b)) {
        (Some(x), Some(y)) => x == y,
        _ => match (string_value(a), string_value(b)) {
            (Some(x), Some(y)) => x == y,
            _ => a == b,
        },
    }
}

/// The "received … but current is …" part of an inequivalent-arg error.
pub fn inequivalent(
    key: &str,
    what: &str,
    received: Option<&AMQPValue>,
    current: Option<&AMQPValue>,
) -> Option<AmqpError> {
    let detail = match (received, current) {
        (None, None) => return None,
        (Some(a), Some(b)) if equivalent(a, b) => return None,
        (Some(a), Some(b)) => format!("received '{}' but current is '{}'", plain(a), plain(b)),
        (Some(a), None) => format!("received {} but current is none", typed(a)),
        (None, Some(b)) => format!("received none but current is {}", typed(b)),
    };
    Some(AmqpError::precondition_failed(format!(
        "inequivalent arg '{key}' for {what}: {detail}"
    )))
}

/// Compare the arguments RabbitMQ compares.
pub fn check_equivalent(
    what: &str,
    received: &FieldTable,
    current: &FieldTable,
) -> Result<(), AmqpError> {
    // An absent x-queue-type means classic.
    let classic = AMQPValue::LongString("classic".into());
    for key in COMPARED {
        let (mut r, mut c) = (received.inner().get(*key), current.inner().get(*key));
        // An absent type equals an explicit "classic" (and nothing else).
        if *key == "x-queue-type" {
            let is_classic =
                |v: Option<&AMQPValue>| v.and_then(string_value).as_deref() == Some("classic");
            if (r.is_none() && is_classic(c)) || (c.is_none() && is_classic(r)) {
                r = Some(&classic);
                c = Some(&classic);
            }
        }
        if let Some(e) = inequivalent(key, what, r, c) {
            return Err(e);
        }
    }
    Ok(())
}

/// The largest TTL or expiry RabbitMQ accepts: ten years, in ms.
pub const MAX_TTL_MS: i128 = 315_360_000_000;

/// The queue type named by `x-queue-type` (classic when absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueType {
    Classic,
    Quorum,
}

/// Validate the arguments and flags of a new queue (`what` names it: "queue 'q' in vhost '/'"),
/// with RabbitMQ's reply texts; returns its type.
pub fn validate(
    what: &str,
    args: &FieldTable,
    durable: bool,
    exclusive: bool,
    auto_delete: bool,
) -> Result<QueueType, AmqpError> {
    let invalid = |key: &str, reason: String| {
        AmqpError::precondition_failed(format!("invalid arg '{key}' for {what}: {reason}"))
    };
    let get = |k: &str| args.inner().get(k);
    let qtype = match get("x-queue-type") {
        None => QueueType::Classic,
        Some(v) => match string_value(v) {
            Some(t) if t == "classic" => QueueType::Classic,
            Some(t) if t == "quorum" => QueueType::Quorum,
            Some(t) if t == "stream" => {
                return Err(invalid(
                    "x-queue-type",
                    "\"stream queues are not supported by Warren yet\"".into(),
                ));
            }
            Some(t) => {
                return Err(invalid(
                    "x-queue-type",
                    format!("\"unsupported queue type '{t}'\""),
                ));
            }
            None => {
                return Err(invalid(
                    "x-queue-type",
                    format!("{{unacceptable_type,{}}}", type_name(v)),
                ));
            }
        },
    };
    if qtype == QueueType::Quorum {
        let bad = if auto_delete {
            Some("auto-delete")
        } else if exclusive {
            Some("exclusive-owner")
        } else if !durable {
            Some("non-durable")
        } else {
            None
        };
        if let Some(p) = bad {
            return Err(AmqpError::precondition_failed(format!(
                "invalid property '{p}' for {what}"
            )));
        }
    }
    let refused: &[&str] = match qtype {
        QueueType::Classic => &[
            "x-delivery-limit",
            "x-dead-letter-strategy",
            "x-max-in-memory-length",
            "x-max-in-memory-bytes",
            "x-quorum-initial-group-size",
            "x-max-age",
            "x-stream-max-segment-size-bytes",
        ],
        QueueType::Quorum => &[
            "x-max-priority",
            "x-queue-mode",
            "x-queue-version",
            "x-max-age",
            "x-stream-max-segment-size-bytes",
        ],
    };
    let type_tag = match qtype {
        QueueType::Classic => "rabbit_classic_queue",
        QueueType::Quorum => "rabbit_quorum_queue",
    };
    for (key, value) in args.inner() {
        let key = key.as_str();
        if refused.contains(&key) {
            return Err(AmqpError::precondition_failed(format!(
                "invalid arg '{key}' for {what} of queue type {type_tag}"
            )));
        }
        // (minimum, maximum, what exceeding the maximum is called)
        let int_rule: Option<(i128, i128, &str)> = match key {
            "x-message-ttl" => Some((0, MAX_TTL_MS, "value_too_large")),
            "x-expires" => Some((1, MAX_TTL_MS, "value_too_large")),
            "x-max-length"
            | "x-max-length-bytes"
            | "x-delivery-limit"
            | "x-max-in-memory-length"
            | "x-max-in-memory-bytes" => Some((0, i128::MAX, "value_too_large")),
            "x-max-priority" => Some((0, 255, "max_value_exceeded")),
            _ => None,
        };
        if let Some((min, max, too_large)) = int_rule {
            let Some(n) = int_value(value) else {
                return Err(invalid(
                    key,
                    format!("\"expected integer, got {}\"", type_name(value)),
                ));
            };
            if n < 0 {
                return Err(invalid(key, format!("{{value_negative,{n}}}")));
            }
            if n < min {
                return Err(invalid(key, format!("{{value_zero,{n}}}")));
            }
            if n > max {
                return Err(invalid(key, format!("{{{too_large},{n}}}")));
            }
            continue;
        }
        match key {
            "x-overflow" => match string_value(value) {
                Some(s)
                    if ["drop-head", "reject-publish", "reject-publish-dlx"]
                        .contains(&s.as_str()) => {}
                Some(_) => return Err(invalid(key, "invalid_overflow".into())),
                None => {
                    return Err(invalid(
                        key,
                        format!("{{unacceptable_type,{}}}", type_name(value)),
                    ));
                }
            },
            "x-queue-mode" => match string_value(value) {
                Some(s) if s == "default" || s == "lazy" => {}
                Some(s) => {
                    return Err(invalid(key, format!("\"unsupported queue mode '{s}'\"")));
                }
                None => {
                    return Err(invalid(
                        key,
                        format!("{{unacceptable_type,{}}}", type_name(value)),
                    ));
                }
            },
            "x-queue-version" => match int_value(value) {
                Some(1) | Some(2) => {}
                Some(n) => {
                    return Err(invalid(key, format!("\"unsupported queue version '{n}'\"")));
                }
                None => {
                    return Err(invalid(
                        key,
                        format!("\"expected integer, got {}\"", type_name(value)),
                    ));
                }
            },
            "x-dead-letter-exchange" if string_value(value).is_none() => {
                return Err(AmqpError::precondition_failed(format!(
                    "invalid type '{}' for arg '{key}' in {what}",
                    type_name(value)
                )));
            }
            "x-dead-letter-routing-key" => {
                if string_value(value).is_none() {
                    return Err(invalid(
                        key,
                        format!("{{unacceptable_type,{}}}", type_name(value)),
                    ));
                }
                if get("x-dead-letter-exchange").is_none() {
                    return Err(invalid(key, "routing_key_but_no_dlx_defined".into()));
                }
            }
            "x-single-active-consumer" if !matches!(value, AMQPValue::Boolean(_)) => {
                return Err(invalid(
                    key,
                    format!("{{unacceptable_type,{}}}", type_name(value)),
                ));
            }
            _ => {}
        }
    }
    Ok(qtype)
}

/// An integer argument, if set (and not negative).
pub fn uint(args: &FieldTable, key: &str) -> Option<u64> {
    args.inner()
        .get(key)
        .and_then(int_value)
        .and_then(|n| u64::try_from(n).ok())
}

/// A string argument, if set.
pub fn string(args: &FieldTable, key: &str) -> Option<String> {
    args.inner().get(key).and_then(string_value)
}

/// A boolean argument (false when absent).
pub fn flag(args: &FieldTable, key: &str) -> bool {
    matches!(args.inner().get(key), Some(AMQPValue::Boolean(true)))
}

/// The x-message-ttl of a queue, in milliseconds.
pub fn message_ttl(args: &FieldTable) -> Option<u64> {
    args.inner()
        .get("x-message-ttl")
        .and_then(int_value)
        .and_then(|n| u64::try_from(n).ok())
}

/// Parse a message's `expiration` property as RabbitMQ does: a decimal number of milliseconds;
/// the error reasons read like RabbitMQ's.
pub fn parse_expiration(s: &str) -> Result<u64, String> {
    let t = s.trim_start();
    let (neg, digits) = match t.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, t.strip_prefix('+').unwrap_or(t)),
    };
    let end = digits
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(digits.len());
    if end == 0 {
        return Err("no_integer".into());
    }
    if end != digits.len() {
        return Err(format!("{{leftover_string,\"{}\"}}", &digits[end..]));
    }
    let n: i128 = digits[..end]
        .parse()
        .map_err(|_| "no_integer".to_string())?;
    let n = if neg { -n } else { n };
    if n < 0 {
        return Err(format!("{{value_negative,{n}}}"));
    }
    if n > MAX_TTL_MS {
        return Err(format!("{{value_too_large,{n}}}"));
    }
    Ok(n as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiration_parsing() {
        assert_eq!(parse_expiration("60000"), Ok(60000));
        assert_eq!(parse_expiration("0"), Ok(0));
        assert_eq!(parse_expiration("4294967296"), Ok(4294967296));
        assert_eq!(parse_expiration("abc"), Err("no_integer".into()));
        assert_eq!(parse_expiration(""), Err("no_integer".into()));
        assert_eq!(parse_expiration("-5"), Err("{value_negative,-5}".into()));
        assert_eq!(
            parse_expiration("99999999999999"),
            Err("{value_too_large,99999999999999}".into())
        );
    }

    #[test]
    fn inequivalent_texts() {
        let a = AMQPValue::LongInt(2000);
        let b = AMQPValue::LongInt(1000);
        let what = "queue 'q' in vhost '/'";
        assert_eq!(
            inequivalent("x-message-ttl", what, Some(&a), Some(&b)).unwrap().text,
            "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received '2000' but current is '1000'"
        );
        assert_eq!(
            inequivalent("x-message-ttl", what, Some(&b), None).unwrap().text,
            "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received the value '1000' of type 'signedint' but current is none"
        );
        assert_eq!(
            inequivalent("x-message-ttl", what, None, Some(&b)).unwrap().text,
            "PRECONDITION_FAILED - inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received none but current is the value '1000' of type 'signedint'"
        );
        assert!(inequivalent(
            "x-message-ttl",
            what,
            Some(&b),
            Some(&AMQPValue::LongLongInt(1000))
        )
        .is_none());
    }
}
