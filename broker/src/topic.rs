//! Topic matching exactly as RabbitMQ does it: words are separated by `.`, empty words count
//! (`a..b` has three words, `a.` two), except that the empty string has no words at all (so `*`
//! does not match `""` but `#` does). `*` matches exactly one word and `#` zero or more words.

/// Whether `routing_key` matches the binding `pattern`.
pub fn matches(pattern: &str, routing_key: &str) -> bool {
    let p = words(pattern);
    let k = words(routing_key);
    match_words(&p, &k)
}

fn words(s: &str) -> Vec<&str> {
    if s.is_empty() {
        Vec::new()
    } else {
        s.split('.').collect()
    }
}

fn match_words(p: &[&str], k: &[&str]) -> bool {
    // Iterative matcher with backtracking on the last `#` (like glob matching), O(p*k) worst case.
    let (mut pi, mut ki) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ki < k.len() {
        if pi < p.len() && p[pi] == "#" {
            star = Some((pi, ki));
            pi += 1;
        } else if pi < p.len() && (p[pi] == "*" || p[pi] == k[ki]) {
            pi += 1;
            ki += 1;
        } else if let Some((sp, sk)) = star {
            pi = sp + 1;
            ki = sk + 1;
            star = Some((sp, sk + 1));
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == "#" {
        pi += 1;
    }
    pi == p.len()
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn rabbitmq_topic_semantics() {
        let cases = [
            ("a.b.c", "a.b.c", true),
            ("a.*.c", "a.b.c", true),
            ("a.*.c", "a.c", false),
            ("a.#.c", "a.c", true),
            ("a.#.c", "a.b.b.c", true),
            ("#", "", true),
            ("#", "a.b", true),
            ("*", "", false),
            ("*.#", "", false),
            ("#.*", "", false),
            ("*.#", "a", true),
            ("*", "a.b", false),
            ("#.#", "a", true),
            ("#.#", "", true),
            ("*.*", "a.", true),
            ("*.*", "a", false),
            ("a.*", "a.", true),
            ("a..b", "a..b", true),
            ("a.*.b", "a..b", true),
            ("#.b", "b", true),
            ("#.b", "a.b.c", false),
            ("a.#", "a", true),
            ("a.#", "ab", false),
            ("#.a.#", "x.a.y", true),
            ("#.a.#", "x.y", false),
            ("*.#.*", "a", false),
            ("*.#.*", "a.b", true),
            ("", "", true),
            ("", "a", false),
            ("a", "a", true),
        ];
        for (pattern, key, expected) in cases {
            assert_eq!(matches(pattern, key), expected, "{pattern:?} vs {key:?}");
        }
    }
}
