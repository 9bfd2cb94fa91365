# The pipeline's image: every `rollout` command, one process per container (docker-compose.yml
# runs each stage from it). Kafka runs as its own service, so the image needs no Java.
#   docker build -t rollout-pipeline .
#   docker run --rm rollout-pipeline --help
FROM python:3.11-slim

# CPU wheels of torch by default: the `hf` replicas and the trainer run on CPU here. Build
# with --build-arg TORCH_INDEX_URL= (empty) to take torch from PyPI instead (CUDA wheels).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/rollout-pipeline

# Dependencies first, in a layer that changes only with pyproject.toml: install the project
# from empty package stubs, then drop it, so editing the code does not reinstall torch.
COPY pyproject.toml README.md ./
RUN mkdir -p pipeline schemas workers \
    && touch pipeline/__init__.py schemas/__init__.py workers/__init__.py \
    && pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} . \
    && pip uninstall -y rollout-pipeline \
    && rm -rf pipeline schemas workers build

COPY schemas ./schemas
COPY workers ./workers
COPY pipeline ./pipeline
RUN pip install --no-deps . && rm -rf build

# Runs unprivileged. /data is where compose mounts the shared volume (model, checkpoints,
# datasets); a new named volume takes this directory's owner.
RUN useradd --create-home --uid 1000 rollout && mkdir -p /data && chown rollout:rollout /data
USER rollout
WORKDIR /data

ENTRYPOINT ["rollout"]
CMD ["--help"]
