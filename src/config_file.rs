//! `warren server --config FILE` (or `WARREN_CONFIG`): the server's settings in a TOML file,
//! one key per command-line option with the option's name (`amqp-listen = "127.0.0.1:5672"`;
//! `amqp_listen` is taken too). The file's settings become command-line options, checked by
//! the same parser: an option given on the command line, or through its environment variable,
//! wins over the file. Booleans are flags (`management-tls = true`); `peers` may be a table
//! (`[peers]` with `1 = "host:port"` lines) and `loopback-users` an array.

use anyhow::{anyhow, bail, Context};
use std::ffi::OsString;

/// `args` (the process's, program name first) with the settings of the config file inserted
/// before the server's own options, when the command is the server's and a file is named.
pub fn expand(args: Vec<OsString>, server: &clap::Command) -> anyhow::Result<Vec<OsString>> {
    // The first word that is not an option: a subcommand, or none (the server, by default).
    let first = args
        .iter()
        .skip(1)
        .position(|a| !a.to_string_lossy().starts_with('-'));
    let at = match first.map(|i| (i + 1, args[i + 1].to_string_lossy().into_owned())) {
        Some((i, word)) if word == "server" => i + 1,
        Some(_) => return Ok(args),
        None => 1,
    };
    let Some(path) = named_file(&args[at..]) else {
        return Ok(args);
    };
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("reading the config file {}", path.display()))?;
    let given = given_options(&args[at..]);
    let settings = options(&text, server, &given)
        .with_context(|| format!("the config file {}", path.display()))?;
    let mut out = args[..at].to_vec();
    out.extend(settings.into_iter().map(OsString::from));
    out.extend_from_slice(&args[at..]);
    Ok(out)
}

/// The file `--config FILE`, `--config=FILE` or `WARREN_CONFIG` names.
fn named_file(args: &[OsString]) -> Option<std::path::PathBuf> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let a = a.to_string_lossy();
        if a == "--config" {
            return it.next().map(Into::into);
        }
        if let Some(v) = a.strip_prefix("--config=") {
            return Some(v.into());
        }
    }
    std::env::var_os("WARREN_CONFIG").map(Into::into)
}

/// The long options the command line gives (`--name` or `--name=value`).
fn given_options(args: &[OsString]) -> Vec<String> {
    args.iter()
        .filter_map(|a| {
            let a = a.to_string_lossy();
            let name = a.strip_prefix("--")?;
            Some(name.split('=').next().unwrap_or(name).to_string())
        })
        .collect()
}

/// The file's settings as options (`--name=value`, `--flag`), leaving out those the command
/// line or an environment variable gives.
fn options(text: &str, server: &clap::Command, given: &[String]) -> anyhow::Result<Vec<String>> {
    let table: toml::Table = text.parse().map_err(|e| anyhow!("{e}"))?;
    let mut out = Vec::new();
    for (key, value) in table {
        let name = key.replace('_', "-");
        let arg = server
            .get_arguments()
            .find(|a| a.get_long() == Some(name.as_str()))
            .filter(|_| name != "config" && name != "help" && name != "version")
            .ok_or_else(|| {
                anyhow!("unknown setting {key:?} (`warren server --help` lists them)")
            })?;
        if given.contains(&name) || arg.get_env().is_some_and(|e| std::env::var_os(e).is_some()) {
            continue;
        }
        let flag = !arg.get_action().takes_values();
        let text = match value {
            toml::Value::Boolean(b) if flag => {
                if b {
                    out.push(format!("--{name}"));
                }
                continue;
            }
            _ if flag => bail!("{key} is a flag: true or false"),
            toml::Value::String(s) => s,
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Array(items) => items
                .iter()
                .map(|v| scalar(&key, v))
                .collect::<anyhow::Result<Vec<_>>>()?
                .join(","),
            toml::Value::Table(t) => t
                .iter()
                .map(|(k, v)| Ok(format!("{k}={}", scalar(&key, v)?)))
                .collect::<anyhow::Result<Vec<_>>>()?
                .join(","),
            toml::Value::Datetime(_) => bail!("{key}: a date is no setting's value"),
        };
        out.push(format!("--{name}={text}"));
    }
    Ok(out)
}

fn scalar(key: &str, v: &toml::Value) -> anyhow::Result<String> {
    match v {
        toml::Value::String(s) => Ok(s.clone()),
        toml::Value::Integer(i) => Ok(i.to_string()),
        _ => bail!("{key}: a list or table of strings or numbers"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction, Command};

    fn server() -> Command {
        Command::new("server")
            .arg(Arg::new("amqp_listen").long("amqp-listen"))
            .arg(Arg::new("heartbeat").long("heartbeat"))
            .arg(Arg::new("peers").long("peers"))
            .arg(Arg::new("loopback_users").long("loopback-users"))
            .arg(
                Arg::new("tls")
                    .long("management-tls")
                    .action(ArgAction::SetTrue),
            )
            .arg(
                Arg::new("node")
                    .long("node-id")
                    .env("WARREN_TEST_CONFIG_NODE_ID"),
            )
    }

    #[test]
    fn settings_become_options_and_the_command_line_wins() {
        let text = r#"
            amqp_listen = "127.0.0.1:5673"
            heartbeat = 30
            management-tls = true
            loopback-users = ["guest", "ops"]
            [peers]
            1 = "127.0.0.1:7001"
            2 = "127.0.0.1:7002"
        "#;
        let mut got = options(text, &server(), &["heartbeat".into()]).unwrap();
        got.sort();
        assert_eq!(
            got,
            [
                "--amqp-listen=127.0.0.1:5673",
                "--loopback-users=guest,ops",
                "--management-tls",
                "--peers=1=127.0.0.1:7001,2=127.0.0.1:7002",
            ]
        );
    }

    #[test]
    fn unknown_keys_and_wrong_types_are_refused_by_name() {
        let e = options("amqp-port = 5672", &server(), &[]).unwrap_err();
        assert!(
            e.to_string().contains("unknown setting \"amqp-port\""),
            "{e}"
        );
        let e = options("management-tls = \"yes\"", &server(), &[]).unwrap_err();
        assert!(e.to_string().contains("a flag"), "{e}");
        assert!(options("heartbeat = ", &server(), &[]).is_err());
        assert!(options("config = \"x.toml\"", &server(), &[]).is_err());
    }

    #[test]
    fn only_the_server_takes_a_file() {
        let args: Vec<OsString> = ["warren", "ctl", "--config", "/nonexistent"]
            .iter()
            .map(OsString::from)
            .collect();
        assert_eq!(expand(args.clone(), &server()).unwrap(), args);
        let args: Vec<OsString> = ["warren", "server", "--config", "/nonexistent"]
            .iter()
            .map(OsString::from)
            .collect();
        let e = expand(args, &server()).unwrap_err();
        assert!(format!("{e:#}").contains("/nonexistent"), "{e:#}");
    }
}
