# One image for every role: the planner and the agents run the same `reshard` CLI.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY reshard reshard
COPY server server
COPY client client
COPY proto proto
# EXTRAS="[torch]" for agents on GPUs (deploy/k8s/overlays/gpu): torch brings the NCCL transport.
ARG EXTRAS=""
RUN pip install --no-cache-dir ".${EXTRAS}" && mkdir -p /var/lib/reshard
EXPOSE 50051 50052
CMD ["reshard", "--help"]
