from __future__ import annotations

import pytest

from vlmq.config.settings import BatchPolicy, Settings


@pytest.fixture
def settings(redis_server, moto_server, request):
    bucket = f"results-{abs(hash(request.node.name)) % 10**8}"
    moto_server.s3().create_bucket(Bucket=bucket)
    return Settings(
        redis_url=redis_server.url,
        results_url=f"s3://{bucket}/runs",
        s3_endpoint_url=moto_server.endpoint,
        batch={
            m: BatchPolicy(max_batch_size=8, max_wait_s=0.02, token_budget=10**6)
            for m in ("text", "image", "video")
        },
    )
