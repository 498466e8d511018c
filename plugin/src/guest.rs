//! The wit-bindgen glue: exports [`crate::handler`] as the `handler`
//! interface of the `snowgate:middleware` world. No logic lives here.

use std::sync::Mutex;

use crate::handler::{self, Config, Decision, IdSource, MachineId, Tick};
use crate::layout::SnowflakeLayout;

wit_bindgen::generate!({
    path: "../wit",
    world: "middleware",
});

use exports::snowgate::middleware::handler::{
    Action, Guest, PluginError, Rejection, Request, Setting,
};
use snowgate::middleware::{clock, identity, request_headers, types::IdLayout};

/// The configuration `configure` was given; it holds for every request the
/// instance serves.
static CONFIG: Mutex<Config> = Mutex::new(Config {
    layout: SnowflakeLayout::TrtllmV1,
});

/// The machine id this instance was given, kept for its later calls: the
/// host starts no call on an instance once the machine id grant it was
/// created under has been withdrawn or replaced, and it checks every answer
/// that took ticks against that grant (see `current-machine-id` in the
/// WIT). Kept, it costs one host call per instance instead of one per
/// request. A refusal is not kept: the next call asks again.
static MACHINE_ID: Mutex<Option<MachineId>> = Mutex::new(None);

/// The component's export.
struct Plugin;

/// Ids from the host's imports.
struct HostIds;

impl IdSource for HostIds {
    fn machine_id(&mut self) -> Result<MachineId, String> {
        let mut kept = MACHINE_ID
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(id) = *kept {
            return Ok(id);
        }
        let id = identity::current_machine_id()?;
        let layout = match id.layout {
            IdLayout::TrtllmV1 => SnowflakeLayout::TrtllmV1,
            IdLayout::TrtllmV2 => SnowflakeLayout::TrtllmV2,
        };
        let id = MachineId {
            value: id.value,
            layout,
        };
        *kept = Some(id);
        Ok(id)
    }

    fn next_tick(&mut self, sequence_space: u32) -> Tick {
        let tick = clock::next_tick(sequence_space);
        Tick {
            millis: tick.millis,
            sequence: tick.sequence,
        }
    }
}

fn config() -> Config {
    *CONFIG
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Guest for Plugin {
    fn name() -> String {
        handler::PLUGIN_NAME.to_string()
    }

    fn version() -> String {
        handler::PLUGIN_VERSION.to_string()
    }

    fn configure(settings: Vec<Setting>) -> Result<(), String> {
        let config =
            Config::from_settings(settings.iter().map(|s| (s.name.as_str(), s.value.as_str())))?;
        *CONFIG
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = config;
        Ok(())
    }

    fn handle(request: Request) -> Result<Action, PluginError> {
        // Only the one header the decision needs is copied in.
        let values = request_headers::get(handler::MSGPACK_HEADER);
        let msgpack = handler::is_msgpack(
            values
                .iter()
                .map(|value| (handler::MSGPACK_HEADER, value.as_slice())),
        );
        match handler::decide(&config(), msgpack, &request.body, &mut HostIds) {
            Ok(Decision::Forward) => Ok(Action::Forward),
            Ok(Decision::ForwardWithBody { body, .. }) => Ok(Action::ForwardWithBody(body)),
            Ok(Decision::Reject(r)) => Ok(Action::Reject(Rejection {
                status: r.status,
                code: r.code.to_string(),
                message: r.message,
            })),
            Err(failure) => Err(PluginError { message: failure.0 }),
        }
    }
}

export!(Plugin);
