"""The CLI's config nodes as structured configs (registered in Hydra's ConfigStore as `schema`), so typos and
wrong types fail at compose time: the engine's own dataclasses (`model`, `cache`, `scheduler`: config/engine.py,
a new engine field is a CLI key with no edit here) beside how it runs (`deploy`), what it answers (`dataset`,
`retriever`, `pipeline`) and how it serves (`serve`). Their values are checked by checks.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from orthrus_rag.config.engine import CacheConfig, ModelConfig, SchedulerConfig


@dataclass
class DatasetConf:
    name: str = "synthetic"  # synthetic | 2wiki | hotpotqa | jsonl (your own questions, from `path`)
    path: str | None = None  # a local JSONL file (2Wiki / HotpotQA format); None: the hub (or the generator)
    hub_id: str | None = None  # another hub dataset of the same shape; None: the named dataset's own id
    split: str | None = None  # the hub split; None: the named dataset's own (validation)
    limit: int | None = None  # the first N questions
    num_questions: int = 60  # synthetic only
    seed: int = 0  # synthetic only


@dataclass
class CorpusConf:
    """What the retriever searches, independent of the dataset (data/corpus.py reads it)."""

    kind: str = "contexts"  # contexts: the dataset's own paragraphs | jsonl | hf | files
    path: str | None = None  # jsonl: a FlashRAG JSONL file (.jsonl or .jsonl.gz); files: a folder of .txt / .md
    hub_id: str | None = None  # hf: a dataset name on the hub, or a loader ("json", "parquet") with data_files
    config: str | None = None  # hf: the dataset's config
    split: str = "train"  # hf
    data_files: list[str] | None = None  # hf: files for a loader such as "json"
    # the record fields (jsonl, hf); None: `contents` ("title\ntext", FlashRAG) or `text` + `title`, and `id`
    id_field: str | None = None
    title_field: str | None = None
    text_field: str | None = None
    chunk_tokens: int = 200  # files: a passage's size in tokens (FlashRAG's wiki passages are ~100 words)
    chunk_overlap: int = 20  # files: tokens shared by neighbouring passages
    limit: int | None = None  # the first N passages


@dataclass
class DeployConf:
    """How the engine runs: one in-process engine, a two-process deployment of it (the baselines), or engine
    replicas on Ray Serve (entrypoints/ray/)."""

    mode: str = "engine"  # engine: one co-scheduled engine; dedicated / disagg-pd: two worker processes; ray
    threads: list[int] | None = None  # torch threads per worker of a deployment (default 1 each)
    num_threads: int | None = None  # the one in-process engine's torch threads (ray: each replica's); None: default
    max_in_flight: int = 8192  # requests the async engine admits at once (more: EngineQueueFull / HTTP 429)
    # ray: engine replicas behind one endpoint; each reserves `num_threads` CPUs (default 1)
    replicas: int = 1
    min_replicas: int | None = None  # both set: Ray Serve autoscales between them, by `target_ongoing_requests`
    max_replicas: int | None = None
    target_ongoing_requests: float = 32.0  # autoscaling: in-flight requests per replica Ray Serve aims at
    upscale_delay_s: float = 30.0  # autoscaling: how long the load must stay above (below) target before Ray
    downscale_delay_s: float = 600.0  # adds (removes) a replica; Ray Serve's defaults
    retries: int = 2  # a call whose replica died is sent again this many times (then: HTTP 503 / a failed question)
    ray_address: str | None = None  # join this cluster ("auto", "ray://host:10001"); None: start a local Ray
    ray_num_cpus: int | None = None  # the local Ray's CPUs; None: the machine's
    gpus_per_replica: float = 0.0  # ray: GPUs each replica reserves (with model.device=cuda)


@dataclass
class RetrieverConf:
    kind: str = "dense"  # dense (FAISS) | bm25 (bm25s) | hybrid (the two fused by reciprocal rank)
    index_type: str = "flat"  # flat | ivf | hnsw | factory (any faiss.index_factory string in `factory`)
    k: int = 5  # passages retrieved per query
    nlist: int = 64  # ivf: inverted lists (FAISS asks 30-256 training vectors per list)
    nprobe: int = 8  # search time: inverted lists visited (ivf, and factory strings with IVF)
    hnsw_m: int = 32  # hnsw: links per node
    ef_search: int = 64  # search time: HNSW's candidate list (hnsw, and factory strings with HNSW)
    factory: str | None = None  # index_type=factory: e.g. "IVF4096,PQ64", "OPQ64,IVF65536_HNSW32,PQ64"
    train_size: int = 131072  # vectors an index that trains is trained on (a seeded sample of the corpus)
    on_disk: bool = False  # an IVF index's lists merged on disk and memory-mapped (indexes larger than memory)
    shard_size: int = 4096  # passages embedded, written and recorded together (the unit a killed build resumes)
    index_dir: str | None = None  # load this prebuilt index (built by `orthrus-rag index`) instead of building
    bm25_k1: float = 1.5  # bm25 / hybrid: term-frequency saturation
    bm25_b: float = 0.75  # bm25 / hybrid: length normalisation
    bm25_method: str = "lucene"  # lucene | robertson | atire | bm25l | bm25+
    dense_weight: float = 1.0  # hybrid: each side's weight in the reciprocal-rank fusion
    bm25_weight: float = 1.0
    rrf_k: float = 60.0  # hybrid: the fusion's rank offset (Cormack et al.'s 60)
    candidates: int = 20  # hybrid: hits asked of each side before fusing (at least k)
    pooling: str = "mean"  # how an embedding pools its hidden states: mean | weighted_mean | cls | first | last
    query_instruction: str | None = None  # a prefix put before each query (not before documents)
    # the LoRA adapter documents and queries embed under (a name in model.adapters or an embedding adapter's);
    # None: the default route (the encoder, else the first embedding adapter, else the bare backbone)
    adapter: str | None = None


@dataclass
class PipelineConf:
    name: str = "iter_retgen"  # iter_retgen | standard_rag | no_retrieval | ircot | flare | self_ask | search_r1
    iterations: int = 2  # iter_retgen: retrieve-then-generate rounds
    max_tokens: int = 96  # tokens of a final generation at most
    temperature: float = 0.0  # 0: greedy
    max_concurrency: int | None = None  # questions in flight; None: sized from the engine (see default_concurrency)
    question_timeout_s: float | None = None  # a question unanswered this long is recorded as failed; None: no limit
    chat_template: bool = True  # send prompts through the model's chat template (false: plain text)
    # how the final iteration writes its answer: free | constrained ("... So the answer is X." forced by a
    # grammar) | json ({"answer": ...}); see pipelines/answers.py
    answer_format: str = "free"
    # whose prompts and answer extraction: native | flashrag (FlashRAG 0.1.2's for standard_rag, iter_retgen,
    # no_retrieval, ircot and flare, to compare scores with FlashRAG's; needs answer_format=free; self_ask and
    # search_r1 keep their own); see pipelines/flashrag_prompts.py
    prompt_style: str = "native"
    # the LoRA adapter every generation runs under (a name in model.adapters); None: the base model
    generation_adapter: str | None = None
    # a reranker (a name in model.rerankers, or "default": the first loaded) scoring each retrieval's retriever.k
    # candidates, of which the best top_k reach the prompt; None: the retriever's top retriever.k as they come
    reranker: str | None = None
    top_k: int = 5
    # ircot / flare: reasoning sentences at most; ircot: passages the prompt holds at most; ircot / flare /
    # self_ask: tokens of one step's generation (a sentence, a follow-up question or its answer)
    max_steps: int = 5
    max_passages: int = 15
    step_tokens: int = 48
    threshold: float = 0.4  # flare: a token less likely than this makes its sentence retrieve
    max_follow_ups: int = 4  # self_ask: follow-up questions at most before the answer is asked for
    # self_ask: the model's turn starts "Yes. Follow up:", so it asks at least one (small models answer at once)
    force_follow_up: bool = True
    # search_r1: searches at most before the model must answer, and (under constrain_format) at least before it may;
    # the protocol's tags (search_r1 | r1_searcher | research); every round written in the protocol by a grammar (for
    # models not trained on it); each round continued with its KV kept where the serving system can (false: the whole
    # text re-submitted)
    max_searches: int = 4
    min_searches: int = 0
    tags: str = "search_r1"
    constrain_format: bool = False
    continuation: bool = True


# An idle kept-alive connection's life on the server: longer than the clients' own pool expiry (httpx and the
# openai client 5 s, aiohttp 15 s). uvicorn's and Ray Serve's default, 5 s, equals httpx's: a client reusing a
# connection just as the server closes it for idleness reads a dropped connection (httpx.ReadError) on a request
# that never ran. A server that keeps idle connections longer than its clients do never closes one under them.
KEEP_ALIVE_S = 75.0


@dataclass
class ServeConf:
    """`orthrus-rag serve`: the OpenAI-compatible server over the configured engine (entrypoints/openai/)."""

    host: str = "127.0.0.1"  # loopback by default; another address exposes the engine to the network
    port: int = 8000  # the port the server listens on
    api_key: str | None = None  # None: the ORTHRUS_API_KEY environment variable, else no key
    served_model_name: str | None = None  # the generation model's name in the API; None: model.name
    default_max_tokens: int = 512  # when a request gives no max_tokens
    log_level: str = "info"  # uvicorn's log level
    # how long an idle kept-alive connection stays open (KEEP_ALIVE_S says why this long)
    keep_alive_s: float = KEEP_ALIVE_S
    # with retriever.index_dir: the index /v1/search searches and /v1/documents adds to (kept in that folder);
    # create_index makes it there, empty, when the folder holds none
    create_index: bool = False


@dataclass
class IngestConf:
    """`orthrus-rag run ingest.path=F`: documents of a FlashRAG JSONL file added to the run's dense index while its
    questions are answered, as bulk work in the same engine steps (entrypoints/ingest.py)."""

    path: str | None = None  # None: no ingest
    id_field: str | None = None  # the record fields, as corpus=jsonl's
    title_field: str | None = None
    text_field: str | None = None
    limit: int | None = None  # the first N documents
    batch_size: int = 256  # documents embedded and added together (each batch lands, durably, as one)
    truncate: bool = True  # cut a document longer than the embedding model's window (as index builds do)


@dataclass
class AppConf:
    dataset: DatasetConf = field(default_factory=DatasetConf)
    corpus: CorpusConf = field(default_factory=CorpusConf)
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    deploy: DeployConf = field(default_factory=DeployConf)
    retriever: RetrieverConf = field(default_factory=RetrieverConf)
    pipeline: PipelineConf = field(default_factory=PipelineConf)
    serve: ServeConf = field(default_factory=ServeConf)
    ingest: IngestConf = field(default_factory=IngestConf)
    # the run's folder (records.jsonl, summary.json, config.yaml, steps.jsonl, index/); a multirun: the sweep's
    # folder, one subfolder per job
    run_dir: str = "runs/${now:%Y-%m-%d_%H-%M-%S}"
    resume: str | None = None  # a run folder to continue: its recorded questions are skipped
    # which failed questions a resume asks again: retryable (the serving system's failures: a replica that died,
    # the question timeout), all, or none (every record stays as it is)
    retry_failed: str = "retryable"
    checkpoint_every: int = 100  # questions between rewrites of summary.json (and fsyncs of records.jsonl)
    seed: int = 0
    progress: bool = True


RETRY_FAILED = ("retryable", "all", "none")

# settings that change how a run goes, not what it computes: a resumed run may change them
OPERATIONAL_KEYS = ("run_dir", "resume", "retry_failed", "progress", "checkpoint_every", "pipeline.max_concurrency",
                    "pipeline.question_timeout_s", "retriever.nprobe", "retriever.ef_search",
                    "deploy.num_threads", "deploy.max_in_flight", "deploy.retries",
                    "deploy.upscale_delay_s", "deploy.downscale_delay_s")


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="schema", node=AppConf)
