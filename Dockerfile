# The Tidal platform image: gateway, scheduler, workers, Flower and the simulated replica.
# Real vLLM replicas use the upstream vllm/vllm-openai image (see docker-compose.yml, profile gpu).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md requirements.lock ./
COPY tidal ./tidal
COPY api ./api
COPY router ./router
COPY priority ./priority
COPY scheduler ./scheduler
COPY workers ./workers
COPY batch_jobs ./batch_jobs
COPY replicas ./replicas
COPY bench ./bench
# tokenizer: gateways tokenise prompts with a model's tokenizer.json (fleet models[].tokenizer).
# requirements.lock: the versions CI tested and scripts/audit checked.
RUN pip install --no-cache-dir -c requirements.lock ".[postgres,k8s,tokenizer]"
ENV TIDAL_DATA_DIR=/data
VOLUME /data
ENTRYPOINT ["tidal"]
