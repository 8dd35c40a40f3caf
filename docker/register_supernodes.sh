#!/bin/sh
# Register every site public key in /public/supernodes with the SuperLink (compose "register" service,
# run through operator.sh). Only public keys are read here: each site made its own key pair and handed over
# its .pub (docs/deployment.md, "TLS and authenticated SuperNodes").
set -eu
for pub in /public/supernodes/*.pub; do
    site=$(basename "$pub" .pub)
    python /app/docker/make_certs.py accept --out /tmp/accepted "$pub"  # refuses anything but a public key
    flwr supernode register "$pub" medflower || echo "($site: not registered now; registered before, or see the error above)"
done
flwr supernode ls medflower
