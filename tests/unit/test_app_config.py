import re
from pathlib import Path

import pytest

from toolledger.config import ConfigError, Settings
from toolledger.worker.app import SWEEP, create_app, transport_options


def redis_settings(**kw):
    return Settings(broker="redis://127.0.0.1:6379/0", db="sqlite:///x.db", **kw)


def test_app__celery_settings_of_design_section_7():
    conf = create_app(redis_settings()).conf
    assert conf.task_acks_late is True
    assert conf.task_reject_on_worker_lost is True
    assert conf.worker_prefetch_multiplier == 1
    # not cancelled at a broker blip (the claim refuses the redelivery; helper-89)
    assert conf.worker_cancel_long_running_tasks_on_connection_loss is False
    assert 0 < conf.task_soft_time_limit < conf.task_time_limit < 30


def test_app__one_visibility_timeout_everywhere_redis_reads_it():
    conf = create_app(redis_settings(visibility_timeout=900, broker_prefix="p:")).conf
    assert conf.broker_transport_options["visibility_timeout"] == 900
    assert conf.result_backend_transport_options["visibility_timeout"] == 900
    assert conf.visibility_timeout == 900
    assert conf.broker_transport_options["global_keyprefix"] == "p:"


def test_app__embedded_broker_gets_no_options_it_would_pass_to_create_engine():
    assert transport_options(Settings(broker="sqla+sqlite:///b.db")) == {}


def test_beat__schedules_the_task_recovery_registers():
    from toolledger.recovery import tasks

    app = create_app(redis_settings())
    assert app.conf.beat_schedule["toolledger-sweep"]["task"] == SWEEP == tasks.SWEEP
    app.loader.import_default_modules()  # what a worker does at start
    assert SWEEP in app.tasks and app.tasks[SWEEP].app is app


def test_beat__sweeps_on_its_own_queue_expiring_past_any_plausible_clock_skew():
    """A sweep message's expiry is the beat's clock read by the sweeper's: at 0.9 of the
    interval (6.3 s here), a beat 10 s behind had every sweep dropped, recovery off (a cold
    review). It waits at least SWEEP_EXPIRES_AT_LEAST; a long interval's is 0.9 of it."""
    from toolledger.worker.app import SWEEP_EXPIRES_AT_LEAST

    settings = redis_settings(sweep_interval=7)
    entry = create_app(settings).conf.beat_schedule["toolledger-sweep"]
    assert entry["task"] == SWEEP and entry["schedule"] == 7
    assert entry["options"]["queue"] == settings.sweep_queue != settings.queue
    assert entry["options"]["expires"] == SWEEP_EXPIRES_AT_LEAST >= 300
    slow = create_app(redis_settings(sweep_interval=1000)).conf.beat_schedule
    assert slow["toolledger-sweep"]["options"]["expires"] == 900


def test_beat__a_sweep_dropped_as_expired_is_a_warning(caplog):
    """Celery drops an expired message at INFO ("Discarding revoked task"): every sweep
    dropped that way was recovery off with nothing above INFO to say so."""
    import logging

    from celery import signals

    app = create_app(redis_settings())
    app.loader.import_default_modules()
    with caplog.at_level(logging.WARNING, logger="toolledger"):
        signals.task_revoked.send(sender=app.tasks[SWEEP], request=None, expired=True)
        signals.task_revoked.send(sender=app.tasks[SWEEP], request=None, expired=False)
    (record,) = [r for r in caplog.records if "sweep message expired" in r.getMessage()]
    assert record.levelno == logging.WARNING and "clock" in record.getMessage()


@pytest.mark.parametrize(
    "kw",
    [
        {"soft_time_limit": 25, "time_limit": 20},  # soft >= hard
        {"time_limit": 40},  # hard >= lease
        {"lease_seconds": 30, "visibility_timeout": 50},  # redelivery while running
    ],
)
def test_settings__inconsistent_limits_refused(kw):
    with pytest.raises(ConfigError):
        redis_settings(**kw).check()


@pytest.mark.parametrize(
    ("env", "says"),
    [
        # only the soft limit set: the hard one is the lease's 5/6 (25 s), which it must name
        (
            {"TOOLLEDGER_SOFT_TIME_LIMIT": "25"},
            "need 0 < TOOLLEDGER_SOFT_TIME_LIMIT (25) < TOOLLEDGER_TIME_LIMIT (25) < "
            "TOOLLEDGER_LEASE_SECONDS (30)",
        ),
        (
            {"TOOLLEDGER_VISIBILITY_TIMEOUT": "10"},
            "TOOLLEDGER_VISIBILITY_TIMEOUT (10) must exceed TOOLLEDGER_LEASE_SECONDS + "
            "TOOLLEDGER_TIME_LIMIT (55)",
        ),
        (
            {"TOOLLEDGER_LEASE_SECONDS": "4", "TOOLLEDGER_DB_TIMEOUT": "3"},
            "TOOLLEDGER_DB_TIMEOUT (3) must be at most half of TOOLLEDGER_LEASE_SECONDS (4)",
        ),
    ],
)
def test_settings__inconsistent_limits_name_the_variables_set(env, says):
    """A worker refused to start saying ``visibility_timeout (10.0) must exceed
    lease_seconds + time_limit``: names no variable a user sets (a cold review of the
    README, which says a refusal names the setting, as ``beat --interval``'s does)."""
    with pytest.raises(ConfigError) as err:
        Settings.from_env(env).check()
    assert says in str(err.value)


def test_settings__defaults_are_consistent_and_read_from_env():
    redis_settings().check()
    s = Settings.from_env({"TOOLLEDGER_LEASE_SECONDS": "12", "TOOLLEDGER_HOME": "/tmp/h"})
    assert (s.lease_seconds, s.soft_time_limit, s.time_limit) == (12, 8, 10)
    assert str(s.db) == "sqlite:////tmp/h/ledger.db"
    with pytest.raises(ConfigError):
        Settings.from_env({"TOOLLEDGER_LEASE_SECONDS": "soon"})


def test_settings__typed_errors_name_the_variable():
    for env, named in (
        ({"TOOLLEDGER_LEASE_SECONDS": "-1"}, "TOOLLEDGER_LEASE_SECONDS='-1'"),
        ({"TOOLLEDGER_MAX_AUTO_RETRIES": "1.5"}, "TOOLLEDGER_MAX_AUTO_RETRIES='1.5'"),
        ({"TOOLLEDGER_SWEEP_INTERVAL": "0"}, "TOOLLEDGER_SWEEP_INTERVAL='0'"),
    ):
        with pytest.raises(ConfigError, match=re.escape(named)) as err:
            Settings.from_env(env)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"(?i)bogus.*not permitted"):
        Settings.from_env({}, bogus="x")  # not a setting: refused, not ignored
    assert Settings.from_env({"TOOLLEDGER_SWEEP_GRACE": "0"}).sweep_grace == 0  # zero allowed


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("TOOLLEDGER_LOG_FORMAT", "xml", "text or json"),
        ("TOOLLEDGER_METRICS", "maybe", "on or off"),
        ("TOOLLEDGER_FOLDER_WATCH", "maybe", "on or off"),
        ("TOOLLEDGER_METRICS_PORT", "x", "a port number"),
        ("TOOLLEDGER_METRICS_PORT", "65536", "a port number"),
        ("TOOLLEDGER_METRICS_PORT", "-1", "a port number"),
        ("TOOLLEDGER_METRICS_PORT", "٣", "a port number"),  # a digit, not an ASCII one
        ("TOOLLEDGER_METRICS_ADDR", "localhost:9808", "an IP address"),
        ("TOOLLEDGER_METRICS_ADDR", "every", "an IP address"),
    ],
)
def test_settings__the_variables_outside_the_settings_refused_malformed(
    variable, value, expected, monkeypatch
):
    """Read where they are used (logs, metrics, the folder watch), they were taken as the
    default or failed late: a metrics port of ``x`` gave a worker no endpoint and no word."""
    named = f"{variable}={value!r}: expected {expected}"
    with pytest.raises(ConfigError, match=re.escape(named)):
        Settings.from_env({variable: value})
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=re.escape(named)):
        Settings()


def test_settings__the_variables_outside_the_settings_in_their_spellings():
    for env in (
        {"TOOLLEDGER_METRICS": " OFF ", "TOOLLEDGER_FOLDER_WATCH": "no"},
        {"TOOLLEDGER_METRICS": "Yes", "TOOLLEDGER_FOLDER_WATCH": "1"},
        {"TOOLLEDGER_METRICS": "", "TOOLLEDGER_FOLDER_WATCH": "  "},
        {"TOOLLEDGER_LOG_FORMAT": "JSON", "TOOLLEDGER_METRICS_PORT": "0"},
        {"TOOLLEDGER_LOG_FORMAT": "", "TOOLLEDGER_METRICS_PORT": "65535"},
    ):
        Settings.from_env(env)
    from toolledger.config import switch

    assert switch({"X": " OFF "}, "X") is False and switch({"X": "yes"}, "X", False) is True
    assert switch({}, "X") is True and switch({"X": ""}, "X", False) is False


def test_settings__the_process_environment_by_default_an_explicit_mapping_alone(monkeypatch):
    monkeypatch.setenv("TOOLLEDGER_LEASE_SECONDS", "12")
    assert Settings().lease_seconds == 12 == Settings.from_env().lease_seconds
    assert Settings.from_env({}).lease_seconds == 30  # the mapping given, nothing else
    assert Settings.from_env(lease_seconds=9).lease_seconds == 9  # overrides win
    monkeypatch.setenv("TOOLLEDGER_LEASE_SECONDS", "soon")
    with pytest.raises(ConfigError, match="TOOLLEDGER_LEASE_SECONDS='soon'"):
        Settings.from_env()


def test_settings__with_validates_and_keeps_derived_values():
    s = redis_settings(lease_seconds=12)
    t = s.with_(sweep_interval=3, queue=None)
    assert (t.sweep_interval, t.queue, t.soft_time_limit) == (3, s.queue, s.soft_time_limit)
    with pytest.raises(ConfigError, match="sweep_interval"):
        s.with_(sweep_interval=-2)


def test_settings__read_by_hand_refuse_what_cannot_be_used():
    """Not a number, not finite (pydantic took inf: every limit derived infinite), not in
    ASCII digits, an integer with a fraction, a bool, too large for a float: each refused,
    named, on one line."""
    for env, named in (
        ({"TOOLLEDGER_LEASE_SECONDS": "nan"}, "finite"),
        ({"TOOLLEDGER_LEASE_SECONDS": "inf"}, "finite"),
        ({"TOOLLEDGER_LEASE_SECONDS": "\u0663\u0660"}, "valid number"),  # Arabic-Indic 30
        ({"TOOLLEDGER_MAX_ARGS_BYTES": "0"}, "from 1 to"),
        ({"TOOLLEDGER_MAX_ARGS_BYTES": "10.5"}, "valid integer"),
        ({"TOOLLEDGER_MAX_AUTO_RETRIES": "-1"}, "greater than or equal to 0"),
    ):
        with pytest.raises(ConfigError, match=named):
            Settings.from_env(env)
    with pytest.raises(ConfigError, match="valid integer"):
        Settings.from_env({}, max_args_bytes=True)
    with pytest.raises(ConfigError, match="finite"):
        Settings.from_env({}, lease_seconds=2**1100)
    with pytest.raises(ConfigError, match=r"and 1 more"):
        Settings.from_env({"TOOLLEDGER_LEASE_SECONDS": "x", "TOOLLEDGER_LOCK_WAIT": "y"})
    env = {
        "TOOLLEDGER_HOME": "/tmp/h",
        "TOOLLEDGER_MAX_ARGS_BYTES": " 7 ",
        "TOOLLEDGER_LOCK_WAIT": "10.0",
    }
    s = Settings.from_env({**env, "TOOLLEDGER_MAX_CONTENT_BYTES": "10.0"})  # as pydantic took it
    assert (s.home, s.max_args_bytes, s.max_content_bytes) == (Path("/tmp/h"), 7, 10)


def test_settings__variables_match_in_any_case_as_before(monkeypatch):
    """pydantic-settings read ``toolledger_db``: passing over it would put a worker on the
    embedded ledger without a word. The upper-case spelling wins a tie."""
    s = Settings.from_env({"toolledger_db": "postgresql://h/a", "Toolledger_Queue": "q"})
    assert (s.db, s.queue) == ("postgresql://h/a", "q")
    both = {"toolledger_queue": "lower", "TOOLLEDGER_QUEUE": "upper", "toolledger_QUEUE": "x"}
    assert Settings.from_env(both).queue == "upper"
    monkeypatch.setenv("toolledger_lease_seconds", "12")
    assert Settings().lease_seconds == 12


def test_settings__frozen_comparable_and_never_showing_a_url():
    url = "postgresql://u:secret@h/db"
    s = Settings.from_env({}, db=url)
    with pytest.raises(AttributeError, match="frozen"):
        s.lease_seconds = 1  # type: ignore[misc]
    assert s == Settings.from_env({}, db=url) != Settings.from_env({})
    assert hash(s) == hash(Settings.from_env({}, db=url))
    assert "secret" not in repr(s) and "lease_seconds=30.0" in repr(s)
    for bad in ("mysql://u:secret@h/db", "postgresql://u:secret/db"):  # "secret" read as a port
        with pytest.raises(ConfigError) as err:
            Settings.from_env({"TOOLLEDGER_DB": bad})
        assert "secret" not in str(err.value) and "TOOLLEDGER_DB" in str(err.value)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        # the ledger where an agent's write_file reaches it (a cold review overwrote ledger.db)
        ({"SANDBOX": "{t}/sb", "HOME": "{t}/sb/tenant1"}, "TOOLLEDGER_HOME: {t}/sb/tenant1 is"),
        ({"SANDBOX": "{t}/sb", "HOME": "{t}/sb"}, "TOOLLEDGER_HOME: {t}/sb is inside"),
        ({"SANDBOX": "{t}/sb", "HOME": "{t}/h", "DB": "sqlite:///{t}/sb/s/l.db"}, "TOOLLEDGER_DB"),
        (
            {"SANDBOX": "{t}/sb", "HOME": "{t}/h", "BROKER": "embedded+sqlite:///{t}/sb/s/b.db"},
            "TOOLLEDGER_BROKER",
        ),
        ({"SANDBOX": "{t}/sb", "HOME": "{t}/link"}, "inside the sandbox"),  # through a symlink
        # a ledger that forgets every call when the process ends
        ({"DB": "sqlite://"}, "in-memory SQLite ledger"),
        ({"DB": "sqlite:///:memory:"}, "in-memory SQLite ledger"),
        ({"DB": "sqlite:///x.db?mode=memory&uri=true"}, "in-memory SQLite ledger"),
        # a directory where the file goes (--db sqlite:///.toolledger): "database unavailable:
        # unable to open database file", exit 1, as if a server were down, the path unnamed
        ({"DB": "sqlite:///{t}/sb"}, "TOOLLEDGER_DB: {t}/sb is a directory"),
        ({"BROKER": "embedded+sqlite:///{t}/sb"}, "TOOLLEDGER_BROKER: {t}/sb is a directory"),
        # a queue Celery reads as a list: jobs published to 'jobs,fast', consumed from neither
        ({"QUEUE": "jobs,fast"}, "TOOLLEDGER_QUEUE='jobs,fast'"),
        ({"QUEUE": "a b"}, "TOOLLEDGER_QUEUE"),
        # a lease past the database's timestamps
        ({"LEASE_SECONDS": "1e12"}, "TOOLLEDGER_LEASE_SECONDS='1e12': Input should be at most"),
    ],
)
def test_settings__a_layout_no_single_value_shows_wrong_is_refused(tmp_path, env, says):
    (tmp_path / "sb").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "sb" / "h", target_is_directory=False)
    t = str(tmp_path)
    given = {f"TOOLLEDGER_{k}": v.format(t=t) for k, v in env.items()}
    given.setdefault("TOOLLEDGER_HOME", f"{t}/home")
    with pytest.raises(ConfigError) as refused:
        Settings.from_env(given)
    assert says.format(t=t) in str(refused.value)
    assert "\n" not in str(refused.value)


def test_settings__ledger_and_sandbox_apart_or_sandbox_in_home_are_fine(tmp_path):
    home = tmp_path / "home"
    assert Settings.from_env({"TOOLLEDGER_HOME": str(home)}).sandbox == home / "sandbox"
    settings = Settings.from_env(
        {"TOOLLEDGER_HOME": str(home), "TOOLLEDGER_SANDBOX": str(tmp_path / "sb"),
         "TOOLLEDGER_QUEUE": "tools.fast-1", "TOOLLEDGER_LEASE_SECONDS": "86400",
         "TOOLLEDGER_DB": f"sqlite:///{tmp_path / 'sbx' / 'ledger.db'}"}
    )  # fmt: skip
    assert settings.queue == "tools.fast-1" and settings.lease_seconds == 86400


def test_settings__a_sqlite_file_at_the_sandboxs_top_is_no_scopes(tmp_path):
    """A scope is a folder under the sandbox: a file at its top is none of theirs."""
    settings = Settings.from_env(
        {"TOOLLEDGER_HOME": str(tmp_path / "home"), "TOOLLEDGER_SANDBOX": str(tmp_path / "sb"),
         "TOOLLEDGER_BROKER": f"embedded+sqlite:///{tmp_path / 'sb' / 'b.db'}"}
    )  # fmt: skip
    assert settings.sandbox == tmp_path / "sb"


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"TOOLLEDGER_BROKER": "memory://"}, "no worker (another process) would ever receive"),
        ({"TOOLLEDGER_BROKER": "filesystem://"}, "use embedded+sqlite:///PATH"),
        ({"TOOLLEDGER_BROKER": "redisx://127.0.0.1:6379/0"}, "scheme 'redisx' is not one of"),
        ({"TOOLLEDGER_BROKER": "embedded+postgresql:///x"}, "scheme 'embedded+postgresql'"),
        # a worker crashed at its first connection, exit 0, three tracebacks (a review)
        ({"TOOLLEDGER_BROKER": "redis://127.0.0.1:6379/abc"}, "its database 'abc' is not a"),
        ({"TOOLLEDGER_BROKER": "redis://127.0.0.1:6379/0/"}, "its database '0/' is not a"),
        ({"TOOLLEDGER_DB": "sqlitex:///x.db"}, "scheme 'sqlitex' is not one of"),
        ({"TOOLLEDGER_DB": "postgresql+psycopg2://u@h/d"}, "scheme 'postgresql+psycopg2'"),
        # the bound exactly as a setting takes it: "1.07374e+09", "6.71089e+07" were neither
        ({"TOOLLEDGER_MAX_CONTENT_BYTES": "1e30"}, "from 1 to 1073741824 bytes (1 GiB)"),
        ({"TOOLLEDGER_MAX_ARGS_BYTES": str(2**40)}, "from 1 to 67108864 bytes (64 MiB)"),
        ({"TOOLLEDGER_SWEEP_GRACE": "1e12"}, "at most 31536000 seconds (a year)"),
        ({"TOOLLEDGER_SWEEP_INTERVAL": "0.01"}, "from 0.1 to 86400 seconds"),
    ],
)
def test_settings__urls_and_bounds_a_run_could_not_use_are_refused(env, says):
    """Each was taken before (a cold review): ``memory://`` recorded the call, exit 0, and no
    worker ever saw it; a scheme matched by its prefix (``sqlitex://``) reached a connection's
    error (exit 1, not 2); 1e30 bytes of content meant no limit; a sweep every 10 ms."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        Settings.from_env({"TOOLLEDGER_HOME": "/tmp/h", **env})


@pytest.mark.parametrize(
    "broker",
    [
        "redis://127.0.0.1:6379/0",
        "rediss://h:6380/0",
        "redis+socket:///run/redis/redis.sock",
        "amqp://guest@h//",
        "pyamqp://h//",
        "embedded+sqlite:///tmp/h/broker.db",
        "sqla+sqlite:///tmp/h/b.db",
        "sqla+postgresql://u@h/d",
    ],
)
def test_settings__the_brokers_kombu_can_carry_jobs_on_are_taken(broker):
    db = "postgresql+psycopg://u@h/d"
    assert Settings.from_env({"TOOLLEDGER_BROKER": broker, "TOOLLEDGER_DB": db}).broker == broker


def test_settings__a_sqlite_file_named_with_its_driver_is_still_kept_out_of_the_sandbox(
    tmp_path,
):
    env = {
        "TOOLLEDGER_SANDBOX": str(tmp_path / "sb"),
        "TOOLLEDGER_DB": f"sqlite+pysqlite:///{tmp_path / 'sb' / 'scope' / 'ledger.db'}",
        "TOOLLEDGER_HOME": str(tmp_path / "home"),
    }
    with pytest.raises(ConfigError, match="inside the sandbox"):
        Settings.from_env(env)


def test_settings__a_misspelt_variable_is_named_once_other_variables_are_not(capsys):
    env = {
        "TOOLLEDGER_HOME": "/tmp/h",
        "TOOLLEDGER_LEASE_SECOND": "5",  # the lease stayed 30 s without a word
        "TOOLLEDGER_API_TOKENS": "x",  # read by the API, not a setting
        "TOOLLEDGER_TEST_PG": "1",
        "TOOLLEDGER_SOMETHING_ELSE_ENTIRELY": "1",
    }
    assert Settings.from_env(env).lease_seconds == 30.0
    Settings.from_env(env)
    err = capsys.readouterr().err
    assert err == (
        "toolledger: warning: TOOLLEDGER_LEASE_SECOND is not a setting "
        "(did you mean TOOLLEDGER_LEASE_SECONDS?): ignored\n"
    )


def test_settings__a_ledger_url_under_another_name_or_prefix_is_named(capsys):
    """``TOOLLEDGER_DATABASE_URL`` (no close name) and ``TOOLEDGER_DB`` (a misspelt prefix)
    were ignored without a word: every process took the embedded ledger of its working
    directory, the Postgres named nowhere used. Never their values (a password)."""
    env = {
        "TOOLLEDGER_HOME": "/tmp/h",
        "TOOLLEDGER_DATABASE_URL": "postgresql://app:s3cret@db:5432/ledger",
        "TOOLLEDGER_QUEUE_URL": "redis://:s3cret@redis:6379/0",
        "TOOLEDGER_DB": "postgresql://app:s3cret@db:5432/ledger",
        "TOOLLEDGER_SOMETHING_ELSE_ENTIRELY": "https://example.com/",  # no URL of ours
        "MYAPP_LEDGER_URL": "postgresql://app:s3cret@db:5432/theirs",  # another prefix, not close
    }
    assert Settings.from_env(env).db.startswith("sqlite:")
    err = capsys.readouterr().err
    assert sorted(err.splitlines()) == [
        "toolledger: warning: TOOLEDGER_DB is not a setting (did you mean TOOLLEDGER_DB?): ignored",
        "toolledger: warning: TOOLLEDGER_DATABASE_URL is not a setting "
        "(did you mean TOOLLEDGER_DB?): ignored",
        "toolledger: warning: TOOLLEDGER_QUEUE_URL is not a setting "
        "(did you mean TOOLLEDGER_BROKER?): ignored",
    ]
    Settings.from_env(env)
    assert capsys.readouterr().err == ""  # once


def test_settings__a_home_that_links_to_nothing_or_a_ledger_that_is_a_folder_is_refused(
    tmp_path,
):
    """A home, sandbox or ledger's folder that is a symbolic link to nothing failed "File
    exists: HOME" or "Too many levels of symbolic links", exit 1; a ledger file that is a
    folder was "database unavailable", exit 1, and a worker waited for it: each a setting
    to mend (exit 2), named."""
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "folder").mkdir()
    for env, says in [
        ({"TOOLLEDGER_HOME": str(tmp_path / "dangling")}, "TOOLLEDGER_HOME: .* does not exist"),
        ({"TOOLLEDGER_HOME": str(tmp_path / "loop" / "h")}, "TOOLLEDGER_HOME: .*loop"),
        (
            {"TOOLLEDGER_HOME": str(tmp_path / "h"), "TOOLLEDGER_SANDBOX": str(tmp_path / "loop")},
            "TOOLLEDGER_SANDBOX: .*symbolic link",
        ),
        (
            {
                "TOOLLEDGER_HOME": str(tmp_path / "h"),
                "TOOLLEDGER_DB": f"sqlite:///{tmp_path}/folder",
            },
            "TOOLLEDGER_DB: .* is a directory: the URL names the SQLite file itself",
        ),
        (
            {
                "TOOLLEDGER_HOME": str(tmp_path / "h"),
                "TOOLLEDGER_DB": f"sqlite:///{tmp_path}/dangling/x/ledger.db",
            },
            "TOOLLEDGER_DB: .*dangling is a symbolic link",
        ),
    ]:
        with pytest.raises(ConfigError, match=says):
            Settings.from_env(env)
    ok = Settings.from_env({"TOOLLEDGER_HOME": str(tmp_path / "new" / "home")})
    assert ok.home == tmp_path / "new" / "home"  # a home not made yet is no link to nothing


def test_demo__never_prints_the_password_of_its_ledgers_url(tmp_path, monkeypatch):
    """``toolledger demo --db postgresql://app:PW@…`` printed the URL as given, password and
    all, in its first line."""
    from toolledger import demo
    from toolledger.config import shown_url

    settings = Settings.from_env(
        {
            "TOOLLEDGER_HOME": str(tmp_path / "h"),
            "TOOLLEDGER_DB": "postgresql://app:s3cret@127.0.0.1:1/ledger",
        }
    )

    def stop_here(_self: object) -> None:
        raise RuntimeError("not started")

    monkeypatch.setattr(demo.Demo, "start", stop_here)
    lines: list[str] = []
    with pytest.raises(RuntimeError):
        demo.run_demo(settings, lines.append)
    assert "postgresql://app:***@127.0.0.1:1/ledger" in lines[0]
    assert not [line for line in lines if "s3cret" in line]
    assert shown_url("sqlite:///a/b.db") == "sqlite:///a/b.db"
    assert shown_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"


def test_settings__the_database_and_broker_urls_from_secret_files(tmp_path, capsys):
    """A URL with a password sat in the environment (``docker inspect``, /proc/PID/environ,
    every child): ``TOOLLEDGER_DB_FILE`` / ``TOOLLEDGER_BROKER_FILE`` name a file holding it,
    as Docker's and Kubernetes' secrets are mounted."""
    db = "postgresql://app:s3cret-pw@db:5432/ledger"
    (tmp_path / "db").write_text(db + "\n")  # an editor's last newline
    (tmp_path / "broker").write_text("redis://:s3cret-pw@redis:6379/0")
    env = {
        "TOOLLEDGER_HOME": str(tmp_path / "h"),
        "TOOLLEDGER_DB_FILE": str(tmp_path / "db"),
        "TOOLLEDGER_BROKER_FILE": str(tmp_path / "broker"),
    }
    made = Settings.from_env(env)
    assert made.db == db and made.broker == "redis://:s3cret-pw@redis:6379/0"
    assert capsys.readouterr().err == ""  # not taken for a misspelt TOOLLEDGER_DB
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "bad").write_text("mysql://root:s3cret-pw@db/x")
    (tmp_path / "latin").write_bytes(b"postgresql://u:\xe9@db/x")
    for change, says in [
        ({"TOOLLEDGER_DB": db}, "TOOLLEDGER_DB and TOOLLEDGER_DB_FILE are both set"),
        ({"TOOLLEDGER_DB_FILE": str(tmp_path / "none")}, "TOOLLEDGER_DB_FILE: cannot read"),
        ({"TOOLLEDGER_DB_FILE": str(tmp_path / "empty")}, "is empty"),
        ({"TOOLLEDGER_DB_FILE": str(tmp_path / "latin")}, "is not UTF-8 text"),
        ({"TOOLLEDGER_DB_FILE": str(tmp_path / "bad")}, "TOOLLEDGER_DB"),
    ]:
        with pytest.raises(ConfigError, match=says) as refused:
            Settings.from_env({**env, **change})
        assert "s3cret" not in str(refused.value)  # never echoed


def test_misconfigured__libpqs_word_on_the_urls_options_and_nothing_else():
    """``sslmode=bogus`` was "database unavailable", exit 1, and a worker waited on it for
    ever: libpq's refusals of the URL's own options are settings to mend (exit 2); a server's
    error that merely says "invalid" is not."""
    from toolledger.ledger.db import misconfigured

    for said in (
        'connection is bad: invalid sslmode value: "bogus"',
        'invalid connection option "foo"',
        'connection is bad: invalid target_session_attrs value: "xx"',
        'missing "=" after "x" in connection info string',
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  '
        'unrecognized configuration parameter "foo"',
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  '
        'invalid value for parameter "statement_timeout": "abc"',
    ):
        assert misconfigured(Exception(said)) == said
    for said in (
        'invalid input value for enum status: "bogus"',
        "connection failed: connection refused",
        'invalid input syntax for type integer: "x"',
        'unrecognized configuration parameter "transaction_timeout"',  # a statement's ERROR
    ):
        assert misconfigured(Exception(said)) is None


def test_settings__redis_urls_kombu_reads_are_taken():
    for url in ("redis://h:6379", "redis://h:6379/", "redis://h:6379/15", "rediss://:pw@h/3",
                "redis://h1:6379/0;redis://h2:6379/0"):  # fmt: skip
        assert Settings.from_env({"TOOLLEDGER_HOME": "/tmp/h", "TOOLLEDGER_BROKER": url}).broker


@pytest.mark.parametrize("option", ["db", "broker"])
def test_cli__a_bad_url_is_named_as_it_was_given(option, capsys, monkeypatch):
    """``--db foo://x`` was said as ``TOOLLEDGER_DB: …``, a variable the user never set (a
    cold review); one read from the environment keeps the variable's name."""
    from tests.helpers import run_cli

    variable = f"TOOLLEDGER_{option.upper()}"
    monkeypatch.delenv(variable, raising=False)
    code, _, err = run_cli(capsys, f"--{option}", "foo://x", "list")
    assert code == 2 and err.startswith(f"toolledger: error: --{option}: scheme 'foo'"), err
    monkeypatch.setenv(variable, "foo://x")
    code, _, err = run_cli(capsys, "list")
    assert code == 2 and err.startswith(f"toolledger: error: {variable}: scheme 'foo'"), err


def test_cli__a_warning_is_one_line_and_a_logged_one_carries_no_prefix_of_ours(monkeypatch):
    """Python's warning, two lines quoting source code, is one line; under a worker (Celery
    captures warnings into logging) it came out "[… WARNING/MainProcess] toolledger: warning:
    …" and an empty line (a cold review): the record holds the text alone."""
    import logging
    import warnings

    from toolledger.cli import warnings_on_one_line

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    warnings_on_one_line()
    said = warnings.formatwarning("ignored\n  option", UserWarning, "x.py", 1)
    assert said == "toolledger: warning: ignored option\n"
    logging.captureWarnings(True)
    try:
        assert warnings.formatwarning("ignored option", UserWarning, "x.py", 1) == "ignored option"
    finally:
        logging.captureWarnings(False)


def test_settings__requeue_after_zero_is_taken_from_the_environment_as_from_the_option():
    """``sweep --requeue-after 0`` re-publishes every approved, unclaimed call (the README's
    own example); ``TOOLLEDGER_REQUEUE_AFTER=0``, the same setting, was refused, exit 2 (a
    cold review of the CLI)."""
    assert (
        Settings.from_env(
            {"TOOLLEDGER_HOME": "/tmp/h", "TOOLLEDGER_REQUEUE_AFTER": "0"}
        ).requeue_after
        == 0
    )
    with pytest.raises(ConfigError, match="greater than or equal to 0"):
        Settings.from_env({"TOOLLEDGER_HOME": "/tmp/h", "TOOLLEDGER_REQUEUE_AFTER": "-1"})


@pytest.mark.parametrize("scheme", ["sqlite", "sqlite+pysqlite"])
def test_settings__a_sqlite_url_under_the_home_directory_is_expanded(tmp_path, scheme):
    """``sqlite:///~/x.db`` made a folder named ``~`` in the working directory and a ledger
    in it (a cold review of the CLI): a ``~`` a shell did not expand (inside a URL, after
    ``--db=``, in a compose file) is the user's home, as in every other path they give."""
    home = str(Path.home())
    s = Settings.from_env(
        {
            "TOOLLEDGER_HOME": str(tmp_path),
            "TOOLLEDGER_DB": f"{scheme}:///~/x.db?timeout=3",
            "TOOLLEDGER_BROKER": "embedded+sqlite:///~/b.db",
        }
    )
    assert s.db == f"{scheme}:///{home}/x.db?timeout=3"
    assert s.broker == f"embedded+sqlite:///{home}/b.db"
    assert Settings.from_env({"TOOLLEDGER_DB": "postgresql://u@h/~x"}).db == "postgresql://u@h/~x"


def test_settings__a_home_or_sandbox_under_the_home_directory_is_expanded():
    """``TOOLLEDGER_SANDBOX=~/sb`` from an environment file (no shell expands it there) made a
    folder named ``~`` in the working directory (a cold review of the CLI)."""
    s = Settings.from_env({"TOOLLEDGER_HOME": "~/tl", "TOOLLEDGER_SANDBOX": "~/sb"})
    assert (s.home, s.sandbox) == (Path.home() / "tl", Path.home() / "sb")
    assert s.db == f"sqlite:///{Path.home() / 'tl' / 'ledger.db'}"


def test_settings__a_urls_surrounding_whitespace_is_no_part_of_it(tmp_path):
    """``TOOLLEDGER_DB`` ending in a newline (a YAML block scalar, a heredoc) made a ledger
    file named ``"ledger.db\\n"``, another ledger than the workers' (a cold review of the
    CLI); a ``_FILE`` secret was stripped already."""
    env = {
        "TOOLLEDGER_HOME": str(tmp_path),
        "TOOLLEDGER_DB": f" sqlite:///{tmp_path}/l.db\n",
        "TOOLLEDGER_BROKER": "redis://127.0.0.1:6379/13\n",
    }
    s = Settings.from_env(env)
    assert (s.db, s.broker) == (f"sqlite:///{tmp_path}/l.db", "redis://127.0.0.1:6379/13")
