# One image for every role: the planner and the agents run the same `reshard` CLI.
#
# BASE: any image with Python 3.11 and its venv module; docker/base-image.sh builds one from Debian's
# packages where no image registry is reached. EXTRAS: "" for the light image (gRPC transport, no torch),
# "[torch]" for the collective transport (gloo, NCCL on GPU nodes: deploy/k8s/overlays/gpu), "[torch,nixl]"
# for that and the NIXL transport (docker/compose.nixl.yml).
ARG BASE=python:3.11-slim
FROM ${BASE}
# A virtual environment, so that one file builds on python:3.11-slim and on Debian's own python3, whose
# system site-packages pip may not write to (PEP 668).
RUN python3 -m venv /opt/reshard
ENV PATH=/opt/reshard/bin:$PATH
WORKDIR /app
COPY pyproject.toml README.md ./
COPY reshard reshard
COPY server server
COPY client client
COPY proto proto
ARG EXTRAS=""
# uid 10001, as deploy/k8s runs it; the planner's state folder is its, and a named volume mounted there
# starts with that owner.
RUN pip install --no-cache-dir --disable-pip-version-check ".${EXTRAS}" \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/reshard reshard \
    && mkdir -p /var/lib/reshard && chown reshard:reshard /var/lib/reshard
USER 10001:10001
EXPOSE 61051 61052
CMD ["reshard", "--help"]
