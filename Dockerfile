# The image for render, derender and proxy: the tokenizer tiers. No torch, no vLLM inside
# (the generate pools run the official vLLM image).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY proxy ./proxy
COPY launch ./launch
RUN pip install --no-cache-dir . && useradd --create-home tokenline
USER tokenline
ENV HF_HUB_OFFLINE=1
ENTRYPOINT ["tokenline"]
