//! Who may log in: the one check behind AMQP's connection.start-ok and the management API's
//! basic auth.

use crate::config::Config;
use crate::node::Shared;

/// Whether these credentials may log in from `ip`: a stored user with the right password, and
/// users in `loopback_users` (guest by default) only from a loopback address, as RabbitMQ.
pub(crate) fn login_allowed(shared: &Shared, user: &str, pass: &str, ip: std::net::IpAddr) -> bool {
    // RabbitMQ's internal users never log in with a blank password.
    if pass.is_empty() {
        return false;
    }
    // The hash is checked outside the broker lock.
    let hash = shared.query(|b| b.user(user).map(|u| u.password_hash.clone()));
    hash.is_some_and(|h| crate::broker::users::password_matches(&h, pass))
        && from_allowed_address(&shared.config, user, ip)
}

/// Whether `user`, named by the common name of the client certificate the CA verified, may
/// log in by EXTERNAL from `ip`: the user exists (no password is asked, as RabbitMQ's
/// rabbitmq_auth_mechanism_ssl with the internal backend) and `loopback_users` allows it.
pub(crate) fn external_login_allowed(shared: &Shared, user: &str, ip: std::net::IpAddr) -> bool {
    shared.query(|b| b.user(user).is_some()) && from_allowed_address(&shared.config, user, ip)
}

/// The `loopback_users` rule: those users only from a loopback address.
fn from_allowed_address(config: &Config, user: &str, ip: std::net::IpAddr) -> bool {
    let loopback_only = config.loopback_users.iter().any(|u| u == user);
    // An IPv4 client of a dual-stack listener arrives as ::ffff:a.b.c.d.
    !loopback_only || ip.to_canonical().is_loopback()
}

#[cfg(test)]
mod tests {
    use super::{from_allowed_address, Config};

    #[test]
    fn guest_only_from_loopback() {
        let config = Config::default();
        let lo: std::net::IpAddr = "127.0.0.1".parse().unwrap();
        let lo6: std::net::IpAddr = "::1".parse().unwrap();
        let remote: std::net::IpAddr = "192.0.2.7".parse().unwrap();
        assert!(from_allowed_address(&config, "guest", lo));
        assert!(from_allowed_address(&config, "guest", lo6));
        // 127.0.0.1 through a dual-stack ([::]) listener.
        let mapped: std::net::IpAddr = "::ffff:127.0.0.1".parse().unwrap();
        assert!(from_allowed_address(&config, "guest", mapped));
        let mapped_remote: std::net::IpAddr = "::ffff:10.1.2.3".parse().unwrap();
        assert!(!from_allowed_address(&config, "guest", mapped_remote));
        assert!(!from_allowed_address(&config, "guest", remote));
        // Any other user (a default user among them) from anywhere.
        assert!(from_allowed_address(&config, "app", remote));
        assert!(from_allowed_address(&config, "app", mapped_remote));
        let open = Config {
            loopback_users: vec![],
            ..Default::default()
        };
        assert!(from_allowed_address(&open, "guest", remote));
    }
}
