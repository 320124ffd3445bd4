//! Issue 2 point 4: exchanges.

use crate::common::*;
use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::ExchangeKind;

fn passive() -> ExchangeDeclareOptions {
    ExchangeDeclareOptions {
        passive: true,
        ..Default::default()
    }
}

#[tokio::test]
async fn declare_every_type_and_flag() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    for kind in [
        ExchangeKind::Direct,
        ExchangeKind::Fanout,
        ExchangeKind::Topic,
        ExchangeKind::Headers,
    ] {
        for (durable, auto_delete, internal) in [
            (false, false, false),
            (true, false, false),
            (false, true, true),
        ] {
            let name = unique("x");
            let opts = ExchangeDeclareOptions {
                durable,
                auto_delete,
                internal,
                ..Default::default()
            };
            ch.exchange_declare(
                name.clone().into(),
                kind.clone(),
                opts,
                FieldTable::default(),
            )
            .await
            .unwrap();
            // Same declaration again is fine; passive finds it.
            ch.exchange_declare(
                name.clone().into(),
                kind.clone(),
                opts,
                FieldTable::default(),
            )
            .await
            .unwrap();
            ch.exchange_declare(
                name.clone().into(),
                kind.clone(),
                passive(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        }
    }
}

#[tokio::test]
async fn predeclared_exchanges_exist() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    for name in [
        "amq.direct",
        "amq.fanout",
        "amq.topic",
        "amq.headers",
        "amq.match",
    ] {
        ch.exchange_declare(
            name.into(),
            ExchangeKind::Direct,
            passive(),
            FieldTable::default(),
        )
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[tokio::test]
async fn passive_declare_of_a_missing_exchange_is_404_and_closes_only_the_channel() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let other = conn.create_channel().await.unwrap();
    let err = ch
        .exchange_declare(
            "nope".into(),
            ExchangeKind::Direct,
            passive(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(
        amqp_error(&err),
        (404, "NOT_FOUND - no exchange 'nope' in vhost '/'".into())
    );
    other
        .queue_declare(
            "".into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn redeclare_with_other_properties_is_406() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let name = unique("x");
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_declare(
        name.clone().into(),
        ExchangeKind::Direct,
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let err = ch
        .exchange_declare(
            name.clone().into(),
            ExchangeKind::Fanout,
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    let (code, text) = amqp_error(&err);
    assert_eq!(code, 406);
    assert_eq!(
        text,
        format!("PRECONDITION_FAILED - inequivalent arg 'type' for exchange '{name}' in vhost '/': received 'fanout' but current is 'direct'")
    );
    let ch = conn.create_channel().await.unwrap();
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let err = ch
        .exchange_declare(
            name.clone().into(),
            ExchangeKind::Direct,
            durable,
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(406));
}

#[tokio::test]
async fn amq_prefix_and_default_exchange_are_reserved() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let err = ch
        .exchange_declare(
            "amq.mine".into(),
            ExchangeKind::Direct,
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(
        amqp_error(&err),
        (
            403,
            "ACCESS_REFUSED - exchange name 'amq.mine' contains reserved prefix 'amq.*'".into()
        )
    );
    let ch = conn.create_channel().await.unwrap();
    let err = ch
        .exchange_delete("amq.direct".into(), ExchangeDeleteOptions::default())
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(403));
    let ch = conn.create_channel().await.unwrap();
    let err = ch
        .exchange_delete("".into(), ExchangeDeleteOptions::default())
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(403));
}

#[tokio::test]
async fn delete_if_unused_refuses_an_exchange_with_bindings() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let x = unique("x");
    ch.exchange_declare(
        x.clone().into(),
        ExchangeKind::Fanout,
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let q = ch
        .queue_declare("".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    ch.queue_bind(
        q.name().clone(),
        x.clone().into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let err = ch
        .exchange_delete(
            x.clone().into(),
            ExchangeDeleteOptions {
                if_unused: true,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(
        amqp_error(&err),
        (
            406,
            format!("PRECONDITION_FAILED - exchange '{x}' in vhost '/' in use")
        )
    );
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_delete(x.clone().into(), Default::default())
        .await
        .unwrap();
    let err = ch
        .exchange_declare(
            x.clone().into(),
            ExchangeKind::Fanout,
            passive(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(404));
}

#[tokio::test]
async fn deleting_a_missing_exchange_is_ok() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.exchange_delete("never-declared".into(), Default::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn unknown_exchange_type_closes_the_connection_with_503() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let err = ch
        .exchange_declare(
            "x-odd".into(),
            ExchangeKind::Custom("no-such-type".into()),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(503));
}

#[tokio::test]
async fn publishing_to_a_missing_or_internal_exchange() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let err = ch
        .basic_publish(
            "missing".into(),
            "k".into(),
            Default::default(),
            b"m",
            Default::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap_err();
    assert_eq!(
        amqp_error(&err),
        (404, "NOT_FOUND - no exchange 'missing' in vhost '/'".into())
    );
    let ch = conn.create_channel().await.unwrap();
    let x = unique("internal");
    ch.exchange_declare(
        x.clone().into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            internal: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.confirm_select(Default::default()).await.unwrap();
    let err = ch
        .basic_publish(
            x.clone().into(),
            "k".into(),
            Default::default(),
            b"m",
            Default::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap_err();
    assert_eq!(
        amqp_error(&err),
        (
            403,
            format!("ACCESS_REFUSED - cannot publish to internal exchange '{x}' in vhost '/'")
        )
    );
}

#[tokio::test]
async fn auto_delete_exchange_goes_with_its_last_binding() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let x = unique("ad");
    ch.exchange_declare(
        x.clone().into(),
        ExchangeKind::Fanout,
        ExchangeDeclareOptions {
            auto_delete: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let q = ch
        .queue_declare("".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    ch.queue_bind(
        q.name().clone(),
        x.clone().into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_unbind(
        q.name().clone(),
        x.clone().into(),
        "".into(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let err = ch
        .exchange_declare(
            x.clone().into(),
            ExchangeKind::Fanout,
            passive(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(reply_code(&err), Some(404));
}

/// Auto-delete exchanges go when their last binding goes, also when that binding went because
/// its destination (a queue or an exchange) was deleted, and so on up a chain of
/// exchange-to-exchange bindings (the RabbitMQ Java client's ExchangeExchangeBindingsAutoDelete).
#[tokio::test]
async fn auto_delete_exchanges_go_up_a_chain_when_the_end_goes() {
    let server = TestServer::start().await;
    let conn = server.connect().await;
    let ch = conn.create_channel().await.unwrap();
    let auto = ExchangeDeclareOptions {
        auto_delete: true,
        ..Default::default()
    };
    for x in ["ad-a", "ad-b", "ad-c"] {
        ch.exchange_declare(x.into(), ExchangeKind::Fanout, auto, FieldTable::default())
            .await
            .unwrap();
    }
    // a -> b -> c -> queue
    ch.exchange_bind(
        "ad-b".into(),
        "ad-a".into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.exchange_bind(
        "ad-c".into(),
        "ad-b".into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_declare("ad-q".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    ch.queue_bind(
        "ad-q".into(),
        "ad-c".into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_delete("ad-q".into(), Default::default())
        .await
        .unwrap();
    let broker = || server.shared.broker.lock();
    for x in ["ad-a", "ad-b", "ad-c"] {
        assert!(!broker().exchange_exists("/", x), "{x} still exists");
    }
    // Deleting the destination exchange directly: its auto-delete source goes too.
    for x in ["ad-s", "ad-d"] {
        ch.exchange_declare(x.into(), ExchangeKind::Fanout, auto, FieldTable::default())
            .await
            .unwrap();
    }
    ch.exchange_bind(
        "ad-d".into(),
        "ad-s".into(),
        "".into(),
        Default::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.exchange_delete("ad-d".into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    assert!(!broker().exchange_exists("/", "ad-s"));
}
