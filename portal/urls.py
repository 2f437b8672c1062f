from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from drf_spectacular.views import SpectacularSwaggerSplitView

from jobs import api, experiment_api, idle_api, prometheus, usage_api
from notifications import api as notifications_api
from notifications import views as notifications_views
from tenants import api as tenants_api
from tenants import sso, sso_api
from tenants import views as tenants_views
from portal import experiment_pages, idle_pages, views
from portal.schema import SchemaView

api_v1 = [
    path("jobs/", api.JobList.as_view(), name="job-list"),
    path("jobs/compare/", api.JobCompare.as_view(), name="job-compare"),  # before jobs/<id>/, which would take it
    path("jobs/<str:job_id>/", api.JobDetail.as_view(), name="job-detail"),
    *[path(f"jobs/<str:job_id>/{action}/", api.JobAction.as_view(action=action), name=f"job-{action}")
      for action in ("halt", "resume", "terminate")],
    path("jobs/<str:job_id>/events/", api.JobEvents.as_view(), name="job-events"),
    path("jobs/<str:job_id>/share/", api.JobSharing.as_view(), name="job-share"),
    path("jobs/<str:job_id>/share/<str:username>/", api.JobUnshare.as_view(), name="job-unshare"),
    path("jobs/<str:job_id>/logs/", api.JobLogs.as_view(), name="job-logs"),
    path("jobs/<str:job_id>/metrics/", api.JobMetrics.as_view(), name="job-metrics"),
    path("jobs/<str:job_id>/resources/", api.JobResources.as_view(), name="job-resources"),
    path("jobs/<str:job_id>/allocations/", api.JobAllocations.as_view(), name="job-allocations"),
    path("jobs/<str:job_id>/artifacts/", api.JobArtifacts.as_view(), name="job-artifacts"),
    path("jobs/<str:job_id>/artifacts/<path:name>", api.JobArtifactDownload.as_view(), name="job-artifact"),
    path("experiments/", experiment_api.ExperimentList.as_view(), name="experiment-list"),
    path("experiments/<str:experiment_id>/", experiment_api.ExperimentDetail.as_view(), name="experiment-detail"),
    path("experiments/<str:experiment_id>/metrics/", experiment_api.ExperimentMetrics.as_view(),
         name="experiment-metrics"),
    *[path(f"experiments/<str:experiment_id>/{action}/", experiment_api.ExperimentAction.as_view(action=action),
           name=f"experiment-{action}") for action in ("pause", "resume", "kill")],
    path("tenants/current/", tenants_api.CurrentTenant.as_view(), name="tenant-current"),
    path("tenants/current/members/", tenants_api.Members.as_view(), name="tenant-members"),
    path("tenants/current/members/<str:username>/", tenants_api.Member.as_view(), name="tenant-member"),
    path("tenants/current/invitations/", tenants_api.TenantInvitations.as_view(), name="tenant-invitations"),
    path("tenants/current/invitations/<int:invitation_id>/", tenants_api.TenantInvitation.as_view(),
         name="tenant-invitation"),
    path("tenants/current/idle-gpus/", idle_api.TenantIdleGpus.as_view(), name="tenant-idle-gpus"),
    path("tenants/current/usage/", usage_api.TenantUsage.as_view(), name="tenant-usage-report"),
    path("tenants/current/usage/csv/", usage_api.TenantUsageCsv.as_view(), name="tenant-usage-csv"),
    path("tenants/<slug:slug>/quota/", tenants_api.TenantQuota.as_view(), name="tenant-quota"),
    path("invitations/", tenants_api.MyInvitations.as_view(), name="invitation-list"),
    path("invitations/<int:invitation_id>/accept/", tenants_api.AcceptInvitation.as_view(), name="invitation-accept"),
    path("invitations/<int:invitation_id>/decline/", tenants_api.DeclineInvitation.as_view(),
         name="invitation-decline"),
    path("account/default-tenant/", tenants_api.DefaultTenant.as_view(), name="default-tenant"),
    path("sso/device/", sso_api.DeviceAuthorization.as_view(), name="sso-device"),
    path("sso/device/token/", sso_api.DeviceToken.as_view(), name="sso-device-token"),
    path("tokens/", tenants_api.Tokens.as_view(), name="token-list"),
    path("tokens/<int:token_id>/", tenants_api.Token.as_view(), name="token-detail"),
    path("cluster/", api.Cluster.as_view(), name="cluster"),
    path("cluster/use/", api.ClusterUse.as_view(), name="cluster-use"),
    path("webhooks/", notifications_api.Webhooks.as_view(), name="webhook-list"),
    path("webhooks/<int:hook_id>/", notifications_api.WebhookDetail.as_view(), name="webhook-detail"),
    path("webhooks/<int:hook_id>/deliveries/", notifications_api.WebhookDeliveries.as_view(), name="webhook-deliveries"),
    path("manifests/validate/", api.ManifestValidate.as_view(), name="manifest-validate"),
    path("ingest/<str:job_id>/", api.ingest_view, name="ingest"),
]

handler404 = "portal.api.not_found"

urlpatterns = [
    path("", views.job_list, name="home"),
    path("submit/", views.submit_page, name="submit"),
    path("submit/examples/<str:name>/manifest.yml", views.example_manifest, name="example-manifest"),
    path("jobs/compare/", views.compare_page, name="compare-page"),
    path("jobs/<str:job_id>/", views.job_page, name="job-page"),
    path("jobs/<str:job_id>/log.txt", views.job_log_download, name="job-log-download"),
    path("experiments/", experiment_pages.experiment_list, name="experiments-page"),
    path("experiments/new/", experiment_pages.new_experiment, name="experiment-new"),  # before <id>/, which would take it
    path("experiments/<str:experiment_id>/", experiment_pages.experiment_page, name="experiment-page"),
    *[path(f"experiments/<str:experiment_id>/{action}/", experiment_pages.experiment_action, {"action": action},
           name=f"experiment-{action}-page") for action in experiment_pages.ACTIONS],
    path("tenant/", views.tenant_usage, name="tenant-usage"),
    path("tenant/idle-gpus/", idle_pages.idle_gpu_policy, name="tenant-idle-gpus-form"),
    path("tenant/members/", tenants_views.members_page, name="tenant-members-page"),
    path("account/tokens/", tenants_views.tokens_page, name="tokens-page"),
    path("account/webhooks/", notifications_views.webhooks_page, name="webhooks-page"),
    path("cluster/", views.cluster_page, name="cluster-page"),
    path("login/", sso.PortalLoginView.as_view(template_name="login.html"), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("sso/login/", sso.SsoLoginView.as_view(), name="sso-login"),
    path("sso/callback/", sso.SsoCallbackView.as_view(), name="sso-callback"),
    path("admin/", admin.site.urls),
    path("api/schema/", SchemaView.as_view(), name="schema"),
    # The split view serves its start-up script as a file: the Content-Security-Policy refuses inline ones.
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="api-docs"),
    path("api/v1/", include(api_v1)),
    path("metrics", prometheus.metrics_view, name="metrics"),  # Prometheus's default path; operators only
]
