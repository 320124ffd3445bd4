//! How deep a client's field tables nest, measured before amq-protocol parses them.
//!
//! amq-protocol parses a table or array inside a table or array by recursion, with no limit
//! on the depth: a 128 KiB frame holds about 26,000 levels (5 bytes each: `A` and a length),
//! which overflows a 2 MiB task stack, and a stack overflow aborts the whole process (no
//! panic to catch). RabbitMQ (Erlang) has no such limit; clients nest a few levels at most
//! (`x-death`: headers, array, table, array). So a frame whose arguments or headers nest
//! deeper than [`MAX_NESTING`] is refused (502 SYNTAX_ERROR) before it is parsed: a
//! deviation, in the README.
//!
//! The walk follows amq-protocol's grammar (`parse_field_table`, `parse_field_array`,
//! `parse_value`) in stream order, with a stack of where each open table or array ends, and
//! stops at the first thing that does not parse: amq-protocol stops there too, after
//! descending no deeper than the walk did.

/// Tables and arrays nested deeper than this (the outermost table is level 1) are refused.
pub const MAX_NESTING: usize = 64;

/// The fields of a method's arguments up to its field table (the only one it has).
#[derive(Clone, Copy)]
enum Field {
    Short,
    ShortStr,
    Octet,
    Table,
}

/// The layout of the arguments of the methods a client sends that hold a field table
/// (AMQP 0-9-1), up to the table.
fn layout(class_id: u16, method_id: u16) -> Option<&'static [Field]> {
    use Field::*;
    Some(match (class_id, method_id) {
        // connection.start-ok: client-properties first.
        (10, 11) => &[Table],
        // exchange.declare: reserved, exchange, type, flags, arguments.
        (40, 10) => &[Short, ShortStr, ShortStr, Octet, Table],
        // exchange.bind, exchange.unbind: reserved, destination, source, key, no-wait.
        (40, 30) | (40, 40) => &[Short, ShortStr, ShortStr, ShortStr, Octet, Table],
        // queue.declare: reserved, queue, flags.
        (50, 10) => &[Short, ShortStr, Octet, Table],
        // queue.bind: reserved, queue, exchange, key, no-wait.
        (50, 20) => &[Short, ShortStr, ShortStr, ShortStr, Octet, Table],
        // queue.unbind: reserved, queue, exchange, key (no flags).
        (50, 50) => &[Short, ShortStr, ShortStr, ShortStr, Table],
        // basic.consume: reserved, queue, consumer tag, flags.
        (60, 20) => &[Short, ShortStr, ShortStr, Octet, Table],
        _ => return None,
    })
}

/// Whether the arguments of method `class_id.method_id` hold a field table nested deeper
/// than [`MAX_NESTING`].
pub fn method_too_deep(class_id: u16, method_id: u16, args: &[u8]) -> bool {
    let Some(fields) = layout(class_id, method_id) else {
        return false;
    };
    let mut pos = 0usize;
    for field in fields {
        let len = match field {
            Field::Short => 2,
            Field::Octet => 1,
            Field::ShortStr => match args.get(pos) {
                Some(&n) => 1 + usize::from(n),
                None => return false,
            },
            Field::Table => return args.get(pos..).is_some_and(table_too_deep),
        };
        pos += len;
    }
    false
}

/// Whether a content header's properties (`payload`: class id, weight, body size, flags,
/// properties) hold a headers table nested deeper than [`MAX_NESTING`].
pub fn header_too_deep(payload: &[u8]) -> bool {
    let Some(flags) = payload.get(12..14) else {
        return false;
    };
    let mut flags = u16::from_be_bytes([flags[0], flags[1]]);
    let mut pos = 14usize;
    // Bit 0 says another word of flags follows (basic has no property past the first 14).
    let first = flags;
    while flags & 1 == 1 {
        let Some(more) = payload.get(pos..pos + 2) else {
            return false;
        };
        flags = u16::from_be_bytes([more[0], more[1]]);
        pos += 2;
    }
    // content-type (bit 15) and content-encoding (bit 14) come before headers (bit 13).
    for bit in [15, 14] {
        if first & (1 << bit) != 0 {
            match payload.get(pos) {
                Some(&n) => pos += 1 + usize::from(n),
                None => return false,
            }
        }
    }
    first & (1 << 13) != 0 && payload.get(pos..).is_some_and(table_too_deep)
}

fn u32_at(b: &[u8], pos: usize) -> Option<usize> {
    let w = b.get(pos..pos.checked_add(4)?)?;
    usize::try_from(u32::from_be_bytes([w[0], w[1], w[2], w[3]])).ok()
}

/// Whether the field table at the start of `b` nests tables and arrays deeper than
/// [`MAX_NESTING`], up to the first thing that does not parse.
pub fn table_too_deep(b: &[u8]) -> bool {
    // Where each open table (true) or array (false) ends.
    let mut open: Vec<(usize, bool)> = Vec::new();
    let Some(len) = u32_at(b, 0) else {
        return false;
    };
    let Some(end) = len.checked_add(4).filter(|e| *e <= b.len()) else {
        return false;
    };
    open.push((end, true));
    let mut pos = 4usize;
    while let Some(&(end, table)) = open.last() {
        if pos == end {
            open.pop();
            continue;
        }
        if table {
            // The entry's name, a short string.
            match b.get(pos) {
                Some(&n) => pos += 1 + usize::from(n),
                None => return false,
            }
        }
        let Some(&kind) = b.get(pos) else {
            return false;
        };
        pos += 1;
        let size = match kind {
            b't' | b'b' | b'B' => 1,
            b's' | b'U' | b'u' => 2,
            b'I' | b'i' | b'f' => 4,
            b'D' => 5,
            b'l' | b'L' | b'd' | b'T' => 8,
            b'V' => 0,
            b'S' | b'x' => match u32_at(b, pos).and_then(|n| n.checked_add(4)) {
                Some(n) => n,
                None => return false,
            },
            b'A' | b'F' => {
                let Some(inner) = u32_at(b, pos)
                    .and_then(|n| n.checked_add(pos + 4))
                    .filter(|e| *e <= end)
                else {
                    return false;
                };
                if open.len() >= MAX_NESTING {
                    return true;
                }
                open.push((inner, kind == b'F'));
                pos += 4;
                continue;
            }
            _ => return false,
        };
        pos += size;
        if pos > end {
            return false;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::frame::WriteContext;
    use amq_protocol::types::{generation::gen_field_table, AMQPValue, FieldArray, FieldTable};

    fn encode(t: &FieldTable) -> Vec<u8> {
        gen_field_table(t)(WriteContext::from(Vec::new()))
            .unwrap()
            .into_inner()
            .0
    }

    /// A table holding arrays nested `depth - 1` deep (the table is level 1), the innermost
    /// holding a table with one of every scalar type.
    fn nested(depth: usize) -> FieldTable {
        let mut leaf = FieldTable::default();
        for (k, v) in [
            ("t", AMQPValue::Boolean(true)),
            ("b", AMQPValue::ShortShortInt(-1)),
            ("s", AMQPValue::ShortInt(-2)),
            ("I", AMQPValue::LongInt(-3)),
            ("l", AMQPValue::LongLongInt(-4)),
            ("f", AMQPValue::Float(1.5)),
            ("d", AMQPValue::Double(2.5)),
            ("T", AMQPValue::Timestamp(7)),
            ("S", AMQPValue::LongString("long".into())),
            ("x", AMQPValue::ByteArray(vec![1, 2].into())),
            ("V", AMQPValue::Void),
        ] {
            leaf.insert(k.into(), v);
        }
        let mut value = AMQPValue::FieldTable(leaf);
        for _ in 0..depth.saturating_sub(2) {
            value = AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::Boolean(false), value]));
        }
        let mut top = FieldTable::default();
        top.insert("a".into(), AMQPValue::LongString("before".into()));
        top.insert("n".into(), value);
        top
    }

    #[test]
    fn nesting_up_to_the_limit_passes_and_one_more_level_does_not() {
        assert!(!table_too_deep(&encode(&nested(3))));
        assert!(!table_too_deep(&encode(&nested(MAX_NESTING))));
        assert!(table_too_deep(&encode(&nested(MAX_NESTING + 1))));
        assert!(!table_too_deep(&encode(&FieldTable::default())));
    }

    #[test]
    fn broken_input_is_left_to_the_parser() {
        let deep = encode(&nested(MAX_NESTING + 1));
        // Cut anywhere before the too-deep level: not refused here, the parser refuses it.
        for n in [0, 3, 4, 10] {
            assert!(!table_too_deep(&deep[..n]), "cut at {n}");
        }
        assert!(!table_too_deep(&[0, 0, 0, 2, 1, b'k']));
        assert!(!table_too_deep(&[0, 0, 0, 3, 0, b'?', 0]));
    }

    #[test]
    fn method_and_header_layouts_reach_their_table() {
        let deep = encode(&nested(MAX_NESTING + 1));
        let ok = encode(&nested(4));
        // queue.declare: reserved, "q", flags, arguments.
        let args = |t: &[u8]| [&[0, 0, 1, b'q', 0][..], t].concat();
        assert!(method_too_deep(50, 10, &args(&deep)));
        assert!(!method_too_deep(50, 10, &args(&ok)));
        assert!(
            !method_too_deep(60, 40, &args(&deep)),
            "basic.publish has no table"
        );
        // A content header with content-type "t" and headers.
        let header = |t: &[u8]| {
            [
                &[0, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xa0, 0, 1, b't'][..],
                t,
            ]
            .concat()
        };
        assert!(header_too_deep(&header(&deep)));
        assert!(!header_too_deep(&header(&ok)));
    }
}
