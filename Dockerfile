# One image for every role: the planner and the agents run the same `reshard` CLI.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY reshard reshard
COPY server server
COPY client client
COPY proto proto
RUN pip install --no-cache-dir . && mkdir -p /var/lib/reshard
EXPOSE 50051 50052
CMD ["reshard", "--help"]
