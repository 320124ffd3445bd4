//! Who may do what in a vhost: RabbitMQ's configure / write / read permissions, regular
//! expressions over the names of queues and exchanges (set through `Op::SetPermissions`).

use fancy_regex::Regex;

/// The three kinds of access RabbitMQ's access-control table names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Configure,
    Write,
    Read,
}

/// What a permission is checked on (named as in RabbitMQ's refusals).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    Queue,
    Exchange,
}

impl Resource {
    fn as_str(self) -> &'static str {
        match self {
            Resource::Queue => "queue",
            Resource::Exchange => "exchange",
        }
    }
}

/// A user's permissions in one vhost, compiled.
#[derive(Debug, Clone)]
pub struct Permissions {
    pub configure: String,
    pub write: String,
    pub read: String,
    compiled: [Rule; 3],
}

/// One compiled expression.
#[derive(Debug, Clone)]
enum Rule {
    /// "" (RabbitMQ: a synonym for `^$`, which no queue or exchange name matches).
    Nothing,
    /// ".*", the usual grant: no regex run on every publish.
    Anything,
    Matches(Regex),
}

/// Compile one permission expression. Unanchored, as RabbitMQ matches (`re:run`), in PCRE's
/// syntax as far as `fancy-regex` takes it: look-around and backreferences too (RabbitMQ's
/// `^(?!amq\.).*` is a common one).
fn compile(expr: &str) -> Result<Rule, String> {
    match expr {
        "" => Ok(Rule::Nothing),
        ".*" => Ok(Rule::Anything),
        _ => fancy_regex::RegexBuilder::new(expr)
            // Permission expressions are short; a hostile one must not take the memory or
            // the time (a match that backtracks past the limit is no match).
            .delegate_size_limit(1 << 20)
            .backtrack_limit(100_000)
            .build()
            .map(Rule::Matches)
            .map_err(|e| e.to_string()),
    }
}

/// Whether `expr` is a valid permission expression (the API refuses others with 400).
pub fn check(expr: &str) -> Result<(), String> {
    compile(expr).map(|_| ())
}

impl Permissions {
    /// Compiled; an expression that does not compile (never accepted by the API, but a store
    /// could hold one) allows nothing.
    pub fn new(configure: &str, write: &str, read: &str) -> Self {
        let c = |e: &str| compile(e).unwrap_or(Rule::Nothing);
        Permissions {
            configure: configure.to_string(),
            write: write.to_string(),
            read: read.to_string(),
            compiled: [c(configure), c(write), c(read)],
        }
    }

    /// Whether `access` to the queue or exchange `name` is allowed.
    pub fn allows(&self, access: Access, name: &str) -> bool {
        let re = match access {
            Access::Configure => &self.compiled[0],
            Access::Write => &self.compiled[1],
            Access::Read => &self.compiled[2],
        };
        match re {
            Rule::Nothing => false,
            Rule::Anything => true,
            Rule::Matches(re) => re.is_match(name).unwrap_or(false),
        }
    }
}

/// A user's topic permissions on one topic exchange: expressions over routing keys, with
/// `{username}` and `{vhost}` expanded (RabbitMQ's variable expansion).
#[derive(Debug, Clone)]
pub struct TopicPermissions {
    /// As set (shown by the API).
    pub write: String,
    pub read: String,
    compiled: Permissions,
}

impl TopicPermissions {
    pub fn new(write: &str, read: &str, user: &str, vhost: &str) -> Self {
        let expand = |e: &str| e.replace("{username}", user).replace("{vhost}", vhost);
        TopicPermissions {
            write: write.to_string(),
            read: read.to_string(),
            compiled: Permissions::new("", &expand(write), &expand(read)),
        }
    }

    /// Whether `access` (write: publish, read: bind) with `routing_key` is allowed.
    pub fn allows(&self, access: Access, routing_key: &str) -> bool {
        self.compiled.allows(access, routing_key)
    }
}

/// RabbitMQ 3.10's refusal of a topic permission (403 ACCESS_REFUSED, a channel error): the
/// same for writing and reading.
pub fn topic_refusal(key: &str, exchange: &str, vhost: &str, user: &str) -> String {
    format!(
        "access to topic '{key}' in exchange '{exchange}' in vhost '{vhost}' refused for user '{user}'"
    )
}

/// RabbitMQ's refusal text (403 ACCESS_REFUSED, a channel error).
pub fn refusal(resource: Resource, name: &str, vhost: &str, user: &str) -> String {
    format!(
        "access to {} '{name}' in vhost '{vhost}' refused for user '{user}'",
        resource.as_str()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expressions_match_anywhere_and_empty_matches_nothing() {
        let p = Permissions::new("^u1-", "", "q");
        assert!(p.allows(Access::Configure, "u1-q"));
        assert!(!p.allows(Access::Configure, "x-u1-q"));
        assert!(!p.allows(Access::Write, "anything"));
        assert!(!p.allows(Access::Write, ""));
        // Unanchored: "q" matches inside a name.
        assert!(p.allows(Access::Read, "aqa"));
        assert!(check("(").is_err());
        // PCRE's look-ahead, as RabbitMQ users write it.
        let no_amq = Permissions::new("^(?!amq\\.).*", "", "");
        assert!(no_amq.allows(Access::Configure, "orders"));
        assert!(!no_amq.allows(Access::Configure, "amq.gen-x"));
        assert!(check("").is_ok() && check(".*").is_ok());
        // One that does not compile allows nothing.
        assert!(!Permissions::new("(", "(", "(").allows(Access::Read, "("));
    }
}
