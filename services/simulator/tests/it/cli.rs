//! `run` end to end against an in-process receiver that verifies every message with the secrets
//! `prepare` gives for the same arguments.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use relay_simulator::cli::prepare;
use relay_simulator::SimulateArgs;
use relay_wire::{Message, SigningSecret};

use crate::common::verify_received;

#[derive(Default)]
struct Receiver {
    secrets: HashMap<String, Vec<SigningSecret>>,
    verified: Mutex<usize>,
    refused: Mutex<Vec<String>>,
}

async fn receive(
    State(receiver): State<Arc<Receiver>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: bytes::Bytes,
) -> StatusCode {
    let secrets = receiver.secrets.get(&id).cloned().unwrap_or_default();
    match verify_received(&headers, &body, &secrets)
        .map_err(|e| e.to_string())
        .and_then(|_| Message::parse(&body).map_err(|e| e.to_string()))
    {
        Ok(message) if message.webhook_endpoint_id.to_string() == id => {
            *receiver.verified.lock().unwrap() += 1;
            StatusCode::NO_CONTENT
        }
        Ok(_) => {
            receiver
                .refused
                .lock()
                .unwrap()
                .push(format!("{id}: another endpoint's message"));
            StatusCode::BAD_REQUEST
        }
        Err(error) => {
            receiver
                .refused
                .lock()
                .unwrap()
                .push(format!("{id}: {error}"));
            StatusCode::UNAUTHORIZED
        }
    }
}

#[tokio::test]
async fn run_sends_verifiable_messages_to_any_receiver() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let args = SimulateArgs {
        receiver_url: format!("http://{addr}"),
        endpoints: 3,
        keys: 2,
        seed: 5,
        rate: 40.0,
        duration_s: 1,
        faults: "all".into(),
        time_compression: 3600.0,
        listen: "127.0.0.1:0".into(),
        select_all: false,
        print_endpoints: false,
        quiet: true,
    };
    let (_, _, infos) = prepare(&args).unwrap();
    let mut receiver = Receiver::default();
    for info in &infos {
        assert_eq!(info.url, format!("http://{addr}/webhooks/{}", info.id));
        let secrets = info
            .secrets
            .iter()
            .map(|s| SigningSecret::parse(s).unwrap())
            .collect();
        receiver.secrets.insert(info.id.to_string(), secrets);
    }
    let receiver = Arc::new(receiver);
    let app = Router::new()
        .route("/webhooks/{id}", post(receive))
        .with_state(receiver.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    relay_simulator::run(args, relay_simulator::ApiTlsArgs::default())
        .await
        .unwrap();
    assert_eq!(*receiver.refused.lock().unwrap(), Vec::<String>::new());
    assert!(
        *receiver.verified.lock().unwrap() >= infos.len(),
        "at least each endpoint's first reset"
    );
}
