#!/bin/sh
# Register every SuperNode public key in /certs/supernodes with the SuperLink (compose "register" service).
# Usage: register_supernodes.sh <superlink host:port>
set -eu
address="${1:-superlink:9200}"
mkdir -p "$FLWR_HOME"
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "compose"

[superlink.compose]
address = "$address"
root-certificates = "/certs/ca.crt"
TOML
for pub in /certs/supernodes/*.pub; do
    site=$(basename "$pub" .pub)
    flwr supernode register "$pub" compose --name "$site" || echo "($site was registered before)"
done
flwr supernode ls compose
