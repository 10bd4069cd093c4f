"""Who may reach the dashboard: loopback only without a token; with $TOKENPATH_TOKEN every page asks
for it, model choices are limited to the project's own; DNS rebinding finds no way in."""
import os
import subprocess
import sys

import pytest
from streamlit import config
from streamlit.testing.v1 import AppTest

from browser import CHROMIUM, REPO, browser_page, serve_app
from engine import access

TOKEN = "correct-horse-battery-staple"
PAGES = ["pages/live.py", "pages/distances.py", "pages/runs.py", "pages/sweeps.py", "pages/hardware.py",
         "pages/kv_calculator.py"]
needs_chromium = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed")


@pytest.fixture
def shared(monkeypatch):
    monkeypatch.setenv(access.TOKEN_ENV, TOKEN)


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True),
                                            ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                            ("", False), (None, False), ("192.168.1.20", False), ("::", False),
                                            ("example.org", False)])
def test_what_counts_as_loopback(host, loopback):
    assert access.is_loopback(host) is loopback


def test_a_lan_address_needs_a_long_token(monkeypatch):
    monkeypatch.delenv(access.TOKEN_ENV, raising=False)
    access.check_bind("127.0.0.1")
    with pytest.raises(access.AccessError, match="without a token"):
        access.check_bind("0.0.0.0")
    monkeypatch.setenv(access.TOKEN_ENV, "short")
    with pytest.raises(access.AccessError, match="at least 12"):
        access.check_bind("192.168.1.20")
    monkeypatch.setenv(access.TOKEN_ENV, TOKEN)
    access.check_bind("0.0.0.0")


def test_the_token_must_match_exactly(shared):
    assert access.token_matches(TOKEN)
    for wrong in ["", None, TOKEN[:-1], TOKEN + " ", TOKEN.upper()]:
        assert not access.token_matches(wrong)


def test_a_shared_dashboard_runs_only_the_project_models(shared, tmp_path):
    own = access.models_dir() / "SmolLM2-135M-Instruct"
    for text in ["default", "", "SmolLM2-135M-Instruct", str(own), str(own) + "/"]:
        assert access.model_choice_allowed(text), text
    for text in ["gpt2", "HuggingFaceTB/SmolLM2-360M", "/etc", str(tmp_path), str(own / ".." / ".."),
                 str(own / "config.json"), "~", "self-int8"]:
        assert not access.model_choice_allowed(text), text
    assert access.model_choice_allowed("self-int8", draft=True)
    assert access.model_choice_allowed("self-exit:4", draft=True)
    assert not access.model_choice_allowed("self-exit:x", draft=True)
    assert "SmolLM2-135M-Instruct" in access.refusal("gpt2")


def test_without_a_token_any_model_field_is_allowed(monkeypatch):
    monkeypatch.delenv(access.TOKEN_ENV, raising=False)
    assert access.model_choice_allowed("gpt2") and access.model_choice_allowed("/some/folder")


def test_the_share_lists_its_hosts_and_never_any_host():
    hosts = access.allowed_hosts("0.0.0.0", ["demo.lan"])
    assert {"127.0.0.1", "localhost", "demo.lan"} <= set(hosts) and "*" not in hosts
    command = access.streamlit_command("192.168.1.20", 8502, [])
    assert command[command.index("--server.address") + 1] == "192.168.1.20"
    assert "192.168.1.20" in access.allowed_hosts("192.168.1.20", [])


@pytest.mark.parametrize("env", [{}, {access.TOKEN_ENV: "short"}], ids=["no token", "short token"])
def test_the_share_command_refuses_a_lan_address_without_a_token(env):
    clean = {k: v for k, v in os.environ.items() if k != access.TOKEN_ENV}
    done = subprocess.run([sys.executable, "-m", "engine.access", "--host", "0.0.0.0", "--port", "1"],
                          cwd=REPO, env={**clean, **env}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and access.TOKEN_ENV in lines[0]


def app_page(page=None) -> AppTest:
    at = AppTest.from_file("../app.py", default_timeout=180)
    if page:
        at.switch_page(page)
    return at.run()


@pytest.mark.parametrize("page", [None, *PAGES])
def test_every_page_asks_for_the_token_first(shared, page_db, page):
    at = app_page(page)
    assert not at.exception
    assert [t.label for t in at.text_input] == ["Access token"]
    assert [t.value for t in at.title] == ["Tokenpath"]  # the sign-in title, none of the page's own
    assert not at.dataframe and not at.selectbox and not at.number_input


def test_a_wrong_or_missing_token_is_refused_and_the_right_one_opens_every_page(shared, page_db):
    at = app_page("pages/runs.py")
    for wrong in ["", "guess", TOKEN[:-1]]:
        at.text_input[0].set_value(wrong)
        at.button[0].click().run()
        assert [e.value for e in at.error] == ["That is not this server's access token."]
        assert [t.value for t in at.title] == ["Tokenpath"]
    at.text_input[0].set_value(TOKEN)
    at.button[0].click().run()
    assert not at.exception and not at.error
    assert [t.value for t in at.title] == ["Runs"]
    assert TOKEN not in str(at.session_state._state.filtered_state)  # the token itself is not kept
    for page in PAGES:
        at.switch_page(page).run()
        assert not at.exception and not at.text_input.values.count(TOKEN), page
        assert "Access token" not in [t.label for t in at.text_input], page


def test_without_a_token_a_non_loopback_server_serves_nothing(monkeypatch, page_db):
    monkeypatch.delenv(access.TOKEN_ENV, raising=False)
    before = config.get_option("server.address")
    config.set_option("server.address", "0.0.0.0")
    try:
        at = app_page()
    finally:
        config.set_option("server.address", before)
    assert not at.exception
    assert len(at.error) == 1 and "without a token" in at.error[0].value
    assert not at.title


@needs_chromium
@pytest.mark.integration
def test_the_share_in_chromium_wrong_right_and_a_rebound_host(tmp_path):
    def share(port):
        return [sys.executable, "-m", "engine.access", "--host", "127.0.0.1", "--port", str(port)]

    outside = []
    with serve_app(tmp_path / "share.duckdb", env={access.TOKEN_ENV: TOKEN}, command=share) as url, \
            browser_page(args=["--host-resolver-rules=MAP rebound.example 127.0.0.1"]) as page:
        page.route("**/*", lambda route: (outside.append(route.request.url), route.abort())
                   if not route.request.url.startswith(url) and "rebound.example" not in route.request.url
                   else route.continue_())
        page.goto(url)
        box = page.get_by_label("Access token", exact=True)
        box.wait_for(timeout=90_000)
        page.screenshot(path="/tmp/share-sign-in.png")
        box.fill("not the token")
        page.get_by_role("button", name="Sign in").click()
        page.get_by_text("That is not this server's access token.").wait_for(timeout=30_000)
        assert page.get_by_text("Latest runs").count() == 0
        page.get_by_label("Access token", exact=True).fill(TOKEN)
        page.get_by_role("button", name="Sign in").click()
        page.get_by_text("Latest runs").wait_for(timeout=90_000)
        page.screenshot(path="/tmp/share-signed-in.png")
        page.get_by_role("link", name="Runs").first.click()
        page.get_by_text("No runs recorded yet").wait_for(timeout=60_000)
        assert page.get_by_label("Access token", exact=True).count() == 0

        # a name re-pointed at 127.0.0.1 gets the page's HTML but never the app's WebSocket
        port = url.rsplit(":", 1)[1]
        page.goto(f"http://rebound.example:{port}/")
        page.wait_for_timeout(15_000)
        page.screenshot(path="/tmp/share-rebound.png")
        assert page.get_by_label("Access token", exact=True).count() == 0 and page.get_by_text("Latest runs").count() == 0
    assert outside == [], outside  # nothing left the machine: no font, no icon, no telemetry


def test_a_shared_dashboard_names_no_server_on_the_serving_page_or_the_story(shared, page_db):
    for page in ["pages/serving.py", "pages/story.py"]:
        at = AppTest.from_file("../app.py", default_timeout=120)
        at.session_state["_signed_in"] = True
        at.switch_page(page).run()
        assert not at.exception, page
        assert access.SERVED_REFUSAL in [i.value for i in at.info], page
        labels = [w.label for w in at.text_input]
        assert not [label for label in labels if "URL" in label or "address" in label or "variable" in label], page


def test_wrong_tokens_are_throttled_per_client_address_and_logged(caplog):
    throttle = access.SignInThrottle()
    for _ in range(throttle.FREE_TRIES):
        assert throttle.wait_s("10.0.0.7") == 0
        throttle.failed("10.0.0.7")
    assert throttle.wait_s("10.0.0.7") > 0  # every session from that address now waits
    assert throttle.wait_s("10.0.0.8") == 0  # another address does not
    assert "10.0.0.7" in caplog.text and "wrong access token" in caplog.text
    throttle.succeeded("10.0.0.7")
    assert throttle.wait_s("10.0.0.7") == 0


def test_the_start_message_names_the_lan_address_and_warns_it_is_unencrypted():
    message = access.start_message("0.0.0.0", 8502)
    assert "0.0.0.0" not in message and "unencrypted" in message and "TLS proxy" in message
    for address in access.lan_addresses():
        assert f"http://{address}:8502" in message
    assert "unencrypted" in open(REPO / "README.md").read()


def test_the_server_refuses_uploads_larger_than_any_page_accepts():
    import tomllib

    settings = tomllib.loads((REPO / ".streamlit" / "config.toml").read_text())
    assert settings["server"]["maxUploadSize"] == access.UPLOAD_MB
    command = access.streamlit_command("0.0.0.0", 8502, [])
    assert command[command.index("--server.maxUploadSize") + 1] == str(access.UPLOAD_MB)


def upload(url: str, session_id: str, xsrf: str) -> int:
    """PUT one small file to Streamlit's upload endpoint for this session; the HTTP status."""
    import urllib.error
    import urllib.request

    boundary = "tokenpath-boundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"config.json\"\r\n"
            f"Content-Type: application/json\r\n\r\n{{\"x\": \"{'y' * 1000}\"}}\r\n--{boundary}--\r\n").encode()
    request = urllib.request.Request(f"{url}/_stcore/upload_file/{session_id}/file-1", data=body, method="PUT",
                                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}",
                                              "X-Xsrftoken": xsrf, "Cookie": f"_streamlit_xsrf={xsrf}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


@needs_chromium
def test_the_share_refuses_uploads_from_a_session_that_has_not_signed_in(tmp_path):
    from streamlit.proto.ForwardMsg_pb2 import ForwardMsg

    def share(port):
        return [sys.executable, "-m", "engine.access", "--host", "127.0.0.1", "--port", str(port)]

    sessions = []

    def watch(socket):
        def frame(payload):
            if isinstance(payload, bytes):
                msg = ForwardMsg()
                msg.ParseFromString(payload)
                if msg.WhichOneof("type") == "new_session" and msg.new_session.initialize.session_id:
                    sessions.append(msg.new_session.initialize.session_id)
        socket.on("framereceived", frame)

    with serve_app(tmp_path / "share.duckdb", env={access.TOKEN_ENV: TOKEN}, command=share) as url, \
            browser_page() as page:
        page.on("websocket", watch)
        page.goto(url)
        page.get_by_label("Access token", exact=True).wait_for(timeout=90_000)
        xsrf = next(c["value"] for c in page.context.cookies() if c["name"] == "_streamlit_xsrf")
        assert sessions
        assert upload(url, sessions[-1], xsrf) == 403  # stored for no one: the session has not signed in
        page.get_by_label("Access token", exact=True).fill(TOKEN)
        page.get_by_role("button", name="Sign in").click()
        page.get_by_text("Latest runs").wait_for(timeout=90_000)
        assert upload(url, sessions[-1], xsrf) == 204  # the KV calculator's config.json upload still works
