//! Nothing here: the tests are in tests/tls.rs.
