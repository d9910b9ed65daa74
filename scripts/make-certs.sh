#!/usr/bin/env bash
# Certificates for tpagent's mutual TLS, for clusters without a site CA or cert-manager.
#
#   scripts/make-certs.sh CA_DIR                       # a new cluster CA (ca.crt, ca.key) in CA_DIR
#   scripts/make-certs.sh CA_DIR OUT_DIR NAME [ADDR...] # a node certificate signed by it:
#                                                      # OUT_DIR/{ca.crt,tls.crt,tls.key}
#
# NAME and every ADDR (IP address or DNS name the node is reached by) go into the certificate's
# subjectAltName, with localhost and 127.0.0.1 (the CLI talks to its own node's agent there).
# OUT_DIR has the layout of a cert-manager Secret, so /etc/tpagent/tls can be either.  Keep
# CA_DIR/ca.key off the nodes.
set -euo pipefail
umask 077
days=${TPAGENT_CERT_DAYS:-825}
[ $# -ge 1 ] || { sed -n '3,10p' "$0" >&2; exit 2; }
ca=$1
mkdir -p "$ca"
if [ ! -f "$ca/ca.key" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 -days "$days" \
    -keyout "$ca/ca.key" -out "$ca/ca.crt" -subj "/CN=tpagent cluster CA" 2>/dev/null
fi
[ $# -ge 3 ] || exit 0
out=$2 name=$3
shift 3
san="DNS:$name,DNS:localhost,IP:127.0.0.1"
for a in "$@"; do
  if [[ $a =~ ^[0-9.]+$ || $a == *:* ]]; then san+=",IP:$a"; else san+=",DNS:$a"; fi
done
mkdir -p "$out"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 -days "$days" \
  -CA "$ca/ca.crt" -CAkey "$ca/ca.key" -keyout "$out/tls.key" -out "$out/tls.crt" -subj "/CN=$name" \
  -addext "subjectAltName=$san" -addext "extendedKeyUsage=serverAuth,clientAuth" \
  -addext "basicConstraints=critical,CA:FALSE" 2>/dev/null
cp "$ca/ca.crt" "$out/ca.crt"
chmod 600 "$out/tls.key"
