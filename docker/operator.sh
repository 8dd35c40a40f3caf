#!/bin/sh
# The operator's `flwr` inside compose (services "operator" and "register"): they share the SuperLink
# container's network namespace, so they reach the Control API on its loopback address, which no hospital
# can reach. Writes the connection "medflower" and runs the given command.
#   docker compose run --rm operator flwr ls medflower
set -eu
mkdir -p "$FLWR_HOME"
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "medflower"

[superlink.medflower]
address = "${SUPERLINK_CONTROL_ADDRESS:-127.0.0.1:9100}"
root-certificates = "/public/ca.crt"
TOML
exec "$@"
