# The image for render, derender and proxy: the tokenizer tiers. No torch, no vLLM inside
# (the generate pools run the official vLLM image).
#
# It runs as a numeric non-root user (Kubernetes' runAsNonRoot can only verify a number) and
# writes nothing outside /tmp: deployments mount it read-only with a tmpfs or emptyDir at /tmp.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY proxy ./proxy
COPY launch ./launch
RUN pip install --no-cache-dir ".[postgres]" \
    && groupadd --gid 10001 tokenline \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp tokenline
USER 10001:10001
ENV HF_HUB_OFFLINE=1 HOME=/tmp PYTHONDONTWRITEBYTECODE=1
ENTRYPOINT ["tokenline"]
