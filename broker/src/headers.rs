//! Headers exchange matching: `x-match` = `all` (default), `any`, `all-with-x`, `any-with-x`.
//! Binding arguments starting with `x-` are ignored unless the mode is a `-with-x` one. A binding
//! argument of type void matches on presence of the header alone.

use amq_protocol::types::{AMQPValue, FieldTable};

pub fn matches(binding_args: &FieldTable, headers: Option<&FieldTable>) -> bool {
    let mode = match binding_args.inner().get("x-match") {
        Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        Some(AMQPValue::ShortString(s)) => s.as_str().to_string(),
        _ => "all".to_string(),
    };
    let (any, with_x) = match mode.as_str() {
        "any" => (true, false),
        "any-with-x" => (true, true),
        "all-with-x" => (false, true),
        _ => (false, false),
    };
    let empty = FieldTable::default();
    let headers = headers.unwrap_or(&empty);
    let mut considered = 0usize;
    for (key, expected) in binding_args.inner() {
        if key.as_str() == "x-match" || (!with_x && key.as_str().starts_with("x-")) {
            continue;
        }
        considered += 1;
        let hit = match (expected, headers.inner().get(key.as_str())) {
            (_, None) => false,
            (AMQPValue::Void, Some(_)) => true,
            (e, Some(h)) => values_equal(e, h),
        };
        if any && hit {
            return true;
        }
        if !any && !hit {
            return false;
        }
    }
    // all: every considered argument matched (vacuously true for none, as RabbitMQ);
    // any: none matched.
    let _ = considered;
    !any
}

/// Compare header values as RabbitMQ does: numbers of different integer widths compare by value,
/// strings by bytes (short and long strings alike).
fn values_equal(a: &AMQPValue, b: &AMQPValue) -> bool {
    use super::args::int_value as as_int;
    fn as_bytes(v: &AMQPValue) -> Option<&[u8]> {
        match v {
            AMQPValue::LongString(s) => Some(s.as_bytes()),
            AMQPValue::ShortString(s) => Some(s.as_str().as_bytes()),
            _ => None,
        }
    }
    if let (Some(x), Some(y)) = (as_int(a), as_int(b)) {
        return x == y;
    }
    if let (Some(x), Some(y)) = (as_bytes(a), as_bytes(b)) {
        return x == y;
    }
    a == b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), v.clone());
        }
        t
    }
    fn s(v: &str) -> AMQPValue {
        AMQPValue::LongString(v.into())
    }

    #[test]
    fn all_and_any() {
        let all = table(&[("x-match", s("all")), ("a", s("1")), ("b", s("2"))]);
        let any = table(&[("x-match", s("any")), ("a", s("1")), ("b", s("2"))]);
        let both = table(&[("a", s("1")), ("b", s("2"))]);
        let one = table(&[("a", s("1"))]);
        assert!(matches(&all, Some(&both)));
        assert!(!matches(&all, Some(&one)));
        assert!(matches(&any, Some(&one)));
        assert!(!matches(&any, None));
        // Default mode is all.
        assert!(matches(&table(&[("a", s("1"))]), Some(&both)));
        // Integer widths compare by value.
        let int_binding = table(&[("n", AMQPValue::LongInt(5))]);
        assert!(matches(
            &int_binding,
            Some(&table(&[("n", AMQPValue::ShortShortUInt(5))]))
        ));
    }

    #[test]
    fn x_headers_only_count_with_x_modes() {
        let headers = table(&[("x-a", s("1"))]);
        let all = table(&[("x-match", s("all")), ("x-a", s("2"))]);
        assert!(matches(&all, Some(&headers)), "x- args ignored in all mode");
        let all_x = table(&[("x-match", s("all-with-x")), ("x-a", s("2"))]);
        assert!(!matches(&all_x, Some(&headers)));
        let any_x = table(&[("x-match", s("any-with-x")), ("x-a", s("1"))]);
        assert!(matches(&any_x, Some(&headers)));
        let any = table(&[("x-match", s("any")), ("x-a", s("1"))]);
        assert!(!matches(&any, Some(&headers)));
    }
}
