"""The router's front doors: the OpenAI HTTP API and the ``pdrouter.v1.Router`` gRPC service.

Everything a client's protocol needs lives here, and nothing else of the router: the HTTP/1.1
server under the door (``http_server``) and its limits (``limits``), the schemas and responses,
the models served (``served_models``) and a request's stream as text (``generation``:
detokenizing, stop strings, timings). The doors call the router through one seam, the
``pdrouter.router.request.Dispatcher`` protocol, and never see workers.
"""
