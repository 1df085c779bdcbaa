# The kvtier operator image; the evictor CronJob runs it too, as `kvtier-evictor`.
# Small, non-root, pinned base. Build: docker build -t kvtier-operator .
FROM python:3.11.7-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator operator
COPY offload offload
COPY evictor evictor
RUN pip wheel --no-cache-dir --wheel-dir /wheels '.[operator,events]'

FROM python:3.11.7-slim-bookworm
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels 'kvtier[operator,events]' \
    && rm -rf /wheels
USER 65532:65532
ENTRYPOINT ["kvtier"]
CMD ["operator"]
