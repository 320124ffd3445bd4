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
    for key in COMPARED {
        if let Some(e) = inequivalent(
            key,
            what,
            received.inner().get(*key),
            current.inner().get(*key),
        ) {
            return Err(e);
        }
    }
    Ok(())
}

/// Validate the arguments of a new queue (`what` names it: "queue 'q' in vhost '/'").
pub fn validate(what: &str, args: &FieldTable) -> Result<(), AmqpError> {
    let invalid = |key: &str, reason: String| {
        AmqpError::precondition_failed(format!("invalid arg '{key}' for {what}: {reason}"))
    };
    for (key, value) in args.inner() {
        let key = key.as_str();
        let int_rule = match key {
            "x-message-ttl"
            | "x-max-length"
            | "x-max-length-bytes"
            | "x-delivery-limit"
            | "x-max-in-memory-length"
            | "x-max-in-memory-bytes" => Some(false),
            "x-expires" => Some(true),
            "x-max-priority" => Some(false),
            _ => None,
        };
        if let Some(positive) = int_rule {
            let Some(n) = int_value(value) else {
                return Err(invalid(
                    key,
                    format!("\"expected integer, got {}\"", type_name(value)),
                ));
            };
            if n < 0 {
                return Err(invalid(key, format!("{{value_negative,{n}}}")));
            }
            if positive && n == 0 {
                return Err(invalid(key, format!("{{value_zero,{n}}}")));
            }
            if key == "x-max-priority" && n > 255 {
                return Err(invalid(key, format!("{{value_too_large,{n},255}}")));
            }
            continue;
        }
        let allowed: Option<&[&str]> = match key {
            "x-overflow" => Some(&["drop-head", "reject-publish", "reject-publish-dlx"]),
            "x-queue-mode" => Some(&["default", "lazy"]),
            _ => None,
        };
        if let Some(allowed) = allowed {
            match string_value(value) {
                Some(s) if allowed.contains(&s.as_str()) => {}
                Some(s) => {
                    return Err(invalid(key, format!("{{unacceptable_value,<<\"{s}\">>}}")));
                }
                None => {
                    return Err(invalid(
                        key,
                        format!("{{unacceptable_type,{}}}", type_name(value)),
                    ));
                }
            }
        }
        if matches!(key, "x-dead-letter-exchange" | "x-dead-letter-routing-key")
            && string_value(value).is_none()
        {
            return Err(invalid(
                key,
                format!("{{unacceptable_type,{}}}", type_name(value)),
            ));
        }
        if key == "x-single-active-consumer" && !matches!(value, AMQPValue::Boolean(_)) {
            return Err(invalid(
                key,
                format!("{{unacceptable_type,{}}}", type_name(value)),
            ));
        }
    }
    Ok(())
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
    // RabbitMQ refuses expirations past its timer limit; 2^32 ms is accepted, 10^14 is not.
    const MAX: i128 = 4_294_967_295_000;
    if n > MAX {
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
