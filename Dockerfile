# tpagent as a node agent / Kubernetes sidecar image: scripts/image.sh builds it as tpagent:VERSION
# (buildah, no Docker engine needed; `docker build -t tpagent:0.1.0 .` works as well).
# Run it privileged with the host's PID namespace (CRIU must see and ptrace the workload):
#   docker run --privileged --pid=host tpagent:0.1.0 doctor
# As a Kubernetes sidecar: deploy/kubernetes-sidecar.yaml.
FROM debian:trixie-slim

RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv ca-certificates debian-archive-keyring util-linux iproute2 nftables \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/tpagent/src
COPY scripts/install-criu.sh scripts/
# CRIU >= 4.2 into /opt/tpagent/criu (trixie ships 4.1, which cannot dump TCP sockets on 6.16+ kernels).
RUN scripts/install-criu.sh

# setup.py compiles the agent's gRPC API into the installed package.
COPY pyproject.toml setup.py README.md ./
COPY tpagent tpagent
COPY snapshot snapshot
COPY transfer transfer
COPY cli cli
COPY host host
COPY tpagent_rank tpagent_rank
# PIP_CERT: a CA bundle for pip where the build machine reaches PyPI through its own (scripts/image.sh).
ARG PIP_CERT
RUN python3 -m venv /opt/tpagent/venv && /opt/tpagent/venv/bin/pip install --no-cache-dir . \
 && /opt/tpagent/venv/bin/pip uninstall -q -y pip \
 && rm -rf /opt/tpagent/src
WORKDIR /

ENV PATH=/opt/tpagent/venv/bin:$PATH
# The agent's work directory (journal, snapshots in flight): root's alone.
RUN install -d -m 700 /var/lib/tpagent
EXPOSE 7400 7401
ENTRYPOINT ["tpagent"]
# As a sidecar: `serve` (see deploy/kubernetes-sidecar.yaml); `doctor` checks the node.
CMD ["serve"]
