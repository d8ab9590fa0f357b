-- wrk2 script for the through-the-edge rows: only sets X-Api-Key, so the test client can be given a
-- key whose limit it never reaches. No response() hook: wrk2 then skips header/body capture, which
-- keeps the generator as cheap as a script-less run.
--
--   WRK_API_KEY=unlimited wrk -t2 -c50 -d60s -R1000 --latency -s wrk/keyed.lua http://127.0.0.1:8080/
--
-- (Equivalent without the script: -H 'X-Api-Key: unlimited'.)

local key = os.getenv("WRK_API_KEY")
if key and key ~= "" then
  wrk.headers["X-Api-Key"] = key
else
  io.stderr:write("keyed.lua: WRK_API_KEY is not set; sending no X-Api-Key\n")
end
